"""KV-cache storage formats of DeepSeek-V4 (spec sections 3.8 and 8): pure JAX, jit-able.

Four formats, each vectorised over any leading (token, block, layer...) dims:

* ``fp8_ds_mla`` (main/sliding and compressed KV, head_dim = nope + rope):
  the NoPE dims as float8_e4m3fn with one UE8M0 (power-of-two) scale per 64 dims, the RoPE
  dims in bfloat16. Stored as three planes -- e4m3 ``[..., nope]``, bf16 ``[..., rope]`` and
  uint8 scale bytes ``[..., scale_bytes]`` -- because a Triton/Pallas kernel cannot bitcast
  byte pairs of a packed row into bf16. Bytes per token ``nope + 2*rope + scale_bytes``:
  584 at DeepSeek-V4-Flash's 448 + 64 (448 + 128 + 8).
* plain bf16 rows (2 bytes per dim, 1024 B/token at head_dim 512).
* plain float32 rows (4 bytes per dim, 2048 B/token at head_dim 512): the exact reference
  format, read only by the pure-JAX references (the ``xla`` attention backend); indexer keys
  likewise (512 B at index_head_dim 128). Nothing is rounded on the way in or out.
* indexer key records: e4m3 ``[..., d]`` plus one fp32 power-of-two scale per key
  (132 B at index_head_dim 128).

Quantisation rule (spec 8.2), per block of 64 NoPE dims (per whole key for the indexer)::

    amax  = max(max|x|, 1e-4)
    scale = 2 ** ceil(log2(amax / 448))      # amax / 448 computed in float32
    q     = e4m3(clamp(x / scale, -448, 448))  # round to nearest even
    byte  = log2(scale) + 127                 # UE8M0 / E8M0; padding bytes are 0

The exponent is computed exactly from the float32 bits of ``amax / 448`` (no ``log2``/``exp2``
calls: XLA's CPU ``exp2`` of an integer and ``log2`` of an exact power of two are not exact), so
every scale is an exact power of two in [2**-22, 2**120] (bytes 105..247).

Special values (tested in tests/test_kv_formats.py); none of them raises:

* zeros: amax is floored at 1e-4, so an all-zero block stores scale 2**-22 (byte 105) and
  decodes to zeros; the sign of -0.0 survives.
* tiny values: a block whose amax is below the 1e-4 floor uses scale 2**-22, so its values of
  magnitude at most 2**-32 (half the smallest e4m3 subnormal, 2**-9, times 2**-22) flush to +-0;
  in general a value flushes to +-0 when it is at most 2**-10 times its block's scale.
* huge finite values: every float32 block gets a finite scale (at most 2**120, byte 247) and its
  values round trip within e4m3's relative error 2**-4, except that magnitudes above
  240 * 2**120 (about 3.19e38) round to 256 * 2**120 = 2**128 and decode to +-inf.
* NaN or +-inf anywhere in a 64-dim NoPE block (in a key for the indexer): the whole block's
  scale is stored as byte 0xFF (E8M0's NaN; fp32 NaN for the indexer), the block's e4m3 values
  are NaN, and the block decodes to NaN -- the other blocks of the token are unaffected. The
  model's KV rounding (dsv4_jax/model/kv_rounding.py) gives the same for +-inf; for NaN its result
  depends on whether XLA's max-reduction propagates the NaN (on CPU it may not, and then only
  the NaN element is NaN), so equality with it is only claimed for finite inputs.
* RoPE dims are a plain round-to-nearest-even bf16 cast: NaN stays NaN, +-inf stays +-inf, and
  finite values above bf16's largest finite value (about 3.39e38) become +-inf.
* input dtypes: float32, bfloat16 and float16 are read as float32; float64 is cast to float32
  first (so values beyond float32's range are inf and decode to NaN as above).

Decoding a scale byte: 0xFF -> NaN, 0 -> 2**-127, otherwise 2**(byte - 127).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FP8_DS_MLA_QUANT_BLOCK = 64
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
UE8M0_BIAS = 127
UE8M0_NAN = 0xFF
_SCALE_ROW_ALIGN = 8  # scale bytes per token are padded to a multiple of 8


# JAX's Triton lowering computes a kernel operand's element offsets in int32 unless the operand
# holds more than 2**32 bytes (then int64), and the GPU sign-extends them. An operand of 1-byte
# elements (e4m3 NoPE dims or indexer keys, UE8M0 scale bytes) with more than 2**31 elements,
# 2 to 4 GiB, so reaches its far rows through negative offsets: an illegal memory access (seen
# on an H200). Wider elements pass 4 GiB before they pass 2**31 elements.
INT32_OFFSET_LIMIT = 2**31
INT64_OFFSETS_ABOVE_BYTES = 2**32


def wraps_int32_offsets(elements: int, itemsize: int) -> bool:
    """Whether a Pallas Triton kernel operand of `elements` elements of `itemsize` bytes would be
    indexed with int32 offsets that wrap (more than 2**31 elements in at most 2**32 bytes)."""
    return elements > INT32_OFFSET_LIMIT and elements * itemsize <= INT64_OFFSETS_ABOVE_BYTES


def idle_layers(layers: int, elements_per_layer: int, itemsize: int) -> int:
    """Layers to add to a pool plane of `layers` x `elements_per_layer` elements so that no kernel
    indexes it with wrapping offsets: 0, or just enough to take it past 2**32 bytes, where JAX's
    lowering uses int64 offsets. The rows of the idle layers are never read or written; only
    planes of 1-byte elements ever get any: at most 2 GiB and one layer more (4 GiB for a
    one-layer plane)."""
    if not wraps_int32_offsets(layers * elements_per_layer, itemsize):
        return 0
    return INT64_OFFSETS_ABOVE_BYTES // (elements_per_layer * itemsize) + 1 - layers


def lead_with_idle_layers(lead: tuple[int, ...], width: int, dtype, ranks: int = 1) -> tuple[int, ...]:
    """A pool plane's leading dims [layers, blocks, units] with its idle layers (`idle_layers`) for
    `width` elements of `dtype` per unit, sized from one of `ranks` data-parallel ranks' share of
    the blocks (each kernel sees one). Rows are addressed per layer as layer * blocks * units +
    row, so layers added after the last never shift a row. Other leads are returned as they are."""
    if len(lead) != 3:
        return lead
    layers, blocks, units = lead
    return (layers + idle_layers(layers, blocks // ranks * units * width, jnp.dtype(dtype).itemsize), blocks, units)


# ---- byte counts -----------------------------------------------------------------------------
def _check_dim(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def fp8_ds_mla_scale_bytes(nope_dim: int) -> int:
    """Scale bytes per token: ceil(nope / 64) UE8M0 bytes padded to a multiple of 8 (at least 8).

    8 whenever nope_dim <= 512 (7 used + 1 padding at DeepSeek-V4's 448)."""
    nope_dim = _check_dim("nope_dim", nope_dim)
    n_blocks = math.ceil(nope_dim / FP8_DS_MLA_QUANT_BLOCK)
    return max(1, math.ceil(n_blocks / _SCALE_ROW_ALIGN)) * _SCALE_ROW_ALIGN


def fp8_ds_mla_bytes_per_token(head_dim: int, rope_dim: int) -> int:
    """nope e4m3 bytes + 2 * rope bf16 bytes + scale bytes: 584 at head_dim 512, rope 64."""
    head_dim = _check_dim("head_dim", head_dim, 1)
    rope_dim = _check_dim("rope_dim", rope_dim)
    if rope_dim > head_dim:
        raise ValueError(f"rope_dim ({rope_dim}) exceeds head_dim ({head_dim})")
    nope = head_dim - rope_dim
    return nope + 2 * rope_dim + fp8_ds_mla_scale_bytes(nope)


def bf16_bytes_per_token(head_dim: int) -> int:
    """Plain bf16 rows: 2 bytes per dim (1024 at head_dim 512)."""
    return 2 * _check_dim("head_dim", head_dim, 1)


def float32_bytes_per_token(head_dim: int) -> int:
    """Plain float32 rows: 4 bytes per dim (2048 at head_dim 512)."""
    return 4 * _check_dim("head_dim", head_dim, 1)


def indexer_fp8_bytes_per_entry(index_head_dim: int) -> int:
    """e4m3 key bytes + one fp32 scale: 132 at index_head_dim 128."""
    return _check_dim("index_head_dim", index_head_dim, 1) + 4


def indexer_bf16_bytes_per_entry(index_head_dim: int) -> int:
    """bf16 indexer keys: 2 bytes per dim (256 at index_head_dim 128)."""
    return 2 * _check_dim("index_head_dim", index_head_dim, 1)


def indexer_float32_bytes_per_entry(index_head_dim: int) -> int:
    """float32 indexer keys: 4 bytes per dim (512 at index_head_dim 128)."""
    return 4 * _check_dim("index_head_dim", index_head_dim, 1)


# ---- UE8M0 scales ----------------------------------------------------------------------------
def ue8m0_encode(amax: jax.Array) -> jax.Array:
    """UE8M0 byte (uint8) of the power-of-two scale for block maxima `amax` (>= 0 or NaN).

    byte = ceil(log2(max(amax, 1e-4) / 448)) + 127, computed exactly from float32 bits;
    0xFF when amax is NaN or inf."""
    a = jnp.maximum(amax.astype(jnp.float32), jnp.float32(AMAX_FLOOR))
    y = a / jnp.float32(E4M3_MAX)  # >= 2.2e-7: always a normal float32 (or inf / NaN)
    bits = lax.bitcast_convert_type(y, jnp.int32)
    exp_field = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    # ceil(log2(y)) for normal y = (exp_field - 127) + (mantissa != 0); byte adds 127 back.
    byte = exp_field + has_mantissa.astype(jnp.int32)
    byte = jnp.where((exp_field == 0xFF) | jnp.isnan(a), UE8M0_NAN, jnp.clip(byte, 0, 0xFE))
    return byte.astype(jnp.uint8)


def ue8m0_decode(scale_bytes: jax.Array) -> jax.Array:
    """float32 scale of UE8M0 bytes: 2**(byte - 127) exactly; 0 -> 2**-127; 0xFF -> NaN."""
    b = scale_bytes.astype(jnp.int32)
    normal = lax.bitcast_convert_type(b << 23, jnp.float32)
    out = jnp.where(b == 0, jnp.float32(2.0**-127), normal)
    return jnp.where(b == UE8M0_NAN, jnp.float32(jnp.nan), out)


def _quantize_blocks(xb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """xb [..., n, block] float32 -> (e4m3 [..., n, block], bytes [..., n])."""
    amax = jnp.max(jnp.abs(xb), axis=-1)
    # XLA:CPU's vectorised max-reduction can drop a NaN, so non-finite blocks are found
    # explicitly rather than through amax.
    nonfinite = jnp.logical_not(jnp.all(jnp.isfinite(xb), axis=-1))
    byte = jnp.where(nonfinite, jnp.uint8(UE8M0_NAN), ue8m0_encode(amax))
    scale = ue8m0_decode(byte)[..., None]
    q = jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, byte


# ---- fp8_ds_mla ------------------------------------------------------------------------------
def fp8_ds_mla_quantize(kv: jax.Array, rope_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split and quantise kv [..., head_dim] into the three fp8_ds_mla planes.

    Returns (nope e4m3 [..., nope], rope bf16 [..., rope], scales uint8 [..., scale_bytes])."""
    head_dim = kv.shape[-1]
    rope_dim = _check_dim("rope_dim", rope_dim)
    if rope_dim > head_dim:
        raise ValueError(f"rope_dim ({rope_dim}) exceeds the last dim of kv ({head_dim})")
    nope_dim = head_dim - rope_dim
    lead = kv.shape[:-1]
    x = kv.astype(jnp.float32)
    nope, rope = x[..., :nope_dim], kv[..., nope_dim:]
    n_scale = fp8_ds_mla_scale_bytes(nope_dim)
    block = FP8_DS_MLA_QUANT_BLOCK
    n_blocks = math.ceil(nope_dim / block)
    if n_blocks:
        pad = n_blocks * block - nope_dim
        if pad:  # zeros never change a block's amax
            nope = jnp.pad(nope, [(0, 0)] * len(lead) + [(0, pad)])
        q, byte = _quantize_blocks(nope.reshape(*lead, n_blocks, block))
        q = q.reshape(*lead, n_blocks * block)[..., :nope_dim]
    else:
        q = jnp.zeros((*lead, 0), jnp.float8_e4m3fn)
        byte = jnp.zeros((*lead, 0), jnp.uint8)
    scales = jnp.concatenate([byte, jnp.zeros((*lead, n_scale - n_blocks), jnp.uint8)], axis=-1)
    return q, rope.astype(jnp.bfloat16), scales


def fp8_ds_mla_dequantize(
    nope: jax.Array, rope: jax.Array, scales: jax.Array, dtype=jnp.float32
) -> jax.Array:
    """Inverse of `fp8_ds_mla_quantize`: [..., nope + rope] in `dtype` (e4m3 * scale in fp32)."""
    nope_dim = nope.shape[-1]
    block = FP8_DS_MLA_QUANT_BLOCK
    n_blocks = math.ceil(nope_dim / block)
    if scales.shape[-1] < n_blocks:
        raise ValueError(f"scales has {scales.shape[-1]} bytes per token, need {n_blocks} for nope {nope_dim}")
    scale = ue8m0_decode(scales[..., :n_blocks])  # [..., n_blocks]
    scale = jnp.repeat(scale, block, axis=-1, total_repeat_length=n_blocks * block)[..., :nope_dim]
    x = nope.astype(jnp.float32) * scale
    return jnp.concatenate([x.astype(dtype), rope.astype(dtype)], axis=-1)


# ---- plain bf16 rows -------------------------------------------------------------------------
def bf16_rows_quantize(kv: jax.Array) -> jax.Array:
    """Plain rows: round to nearest even bf16 (NaN/inf kept; > ~3.39e38 becomes inf)."""
    return kv.astype(jnp.bfloat16)


def bf16_rows_dequantize(rows: jax.Array, dtype=jnp.float32) -> jax.Array:
    return rows.astype(dtype)


# ---- plain float32 rows ----------------------------------------------------------------------
def float32_rows_quantize(kv: jax.Array) -> jax.Array:
    """Plain float32 rows: exact for float32, bfloat16 and float16 input (float64 is rounded to
    float32, the only precision the model computes in)."""
    return kv.astype(jnp.float32)


def float32_rows_dequantize(rows: jax.Array, dtype=jnp.float32) -> jax.Array:
    return rows.astype(dtype)


# ---- indexer keys ----------------------------------------------------------------------------
def indexer_fp8_quantize(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """keys [..., d] -> (e4m3 [..., d], fp32 power-of-two scale [...]); NaN scale if non-finite."""
    q, byte = _quantize_blocks(keys.astype(jnp.float32)[..., None, :])
    return q[..., 0, :], ue8m0_decode(byte[..., 0])


def indexer_fp8_dequantize(e4m3: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (e4m3.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


__all__ = [
    "AMAX_FLOOR",
    "E4M3_MAX",
    "FP8_DS_MLA_QUANT_BLOCK",
    "UE8M0_BIAS",
    "UE8M0_NAN",
    "bf16_bytes_per_token",
    "bf16_rows_dequantize",
    "bf16_rows_quantize",
    "fp8_ds_mla_bytes_per_token",
    "fp8_ds_mla_dequantize",
    "fp8_ds_mla_quantize",
    "fp8_ds_mla_scale_bytes",
    "float32_bytes_per_token",
    "float32_rows_dequantize",
    "float32_rows_quantize",
    "indexer_bf16_bytes_per_entry",
    "indexer_float32_bytes_per_entry",
    "indexer_fp8_bytes_per_entry",
    "indexer_fp8_dequantize",
    "indexer_fp8_quantize",
    "ue8m0_decode",
    "ue8m0_encode",
]
