"""Fused quantise-and-scatter of new K = V rows into the paged pools: kernel, reference, wrapper.

`write_kv` writes window rows or compressed entries (the same code: only the slot mapping
differs) as fp8_ds_mla planes (e4m3 NoPE dims with one UE8M0 scale byte per 64 dims, bf16 RoPE
dims, zero padding bytes) or plain bf16 rows; `write_indexer_keys` writes indexer keys as e4m3
plus one fp32 power-of-two scale per key (or bf16 rows). Slots are flat rows of one pool layer,
`block * units + offset`; a slot < 0 or past the pool is skipped. Formats and their special
values are defined in pallas_kernels/formats.py; the kernel reproduces them bit for bit.

`write_kv_reference` is the one pure-JAX writer of the project (the `xla` backend, the paged
cache and the tests all use it): the same arguments as the kernel wrappers, `(pool, rows, slots,
layer)`, for every pool format (the plane count and dtype tell them apart), including float32
rows (KV or indexer keys), the exact reference format that the kernel refuses.

Kernel (Pallas, Triton backend): grid (ceil(T / block_k),); a program quantises block_k rows,
64 dims at a time, and scatters them with masked stores straight into the aliased pool planes
(in place under jit with donation). The scale exponent is computed from float32 bits, exactly as
formats.ue8m0_encode, and values are scaled by multiplying with an exact power of two: no log2,
exp2 or division, whose GPU versions are approximate.

Rows whose slot is skipped are replaced, before the kernel, by a copy of the first written row
(same slot, same data), so that a masked-off lane never aliases a real write in the Pallas
interpreter (which emulates a masked scatter by writing back the old value); on the GPU the
duplicate stores write identical bytes. Slots must be distinct within one call.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import formats, tuning
from pallas_kernels.paged_attention import (
    DIM_CHUNK,
    FLOAT32,
    chunk_width,
    flatten_pool,
    full_block,
    kernel_format,
    refuse_wrapping_offsets,
)


# ---- kernel -----------------------------------------------------------------------------------
def _ue8m0_byte_and_inverse(amax: jax.Array, nonfinite: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row UE8M0 byte (int32) and the exact fp32 inverse scale 2**(127 - byte).

    byte = ceil(log2(max(amax, 1e-4) / 448)) + 127 from the bits of a = max(amax, 1e-4):
    a = m * 2**E with m in [1, 2); a / 448 = (m / 1.75) * 2**(E - 8), whose ceil(log2) is E - 8,
    plus 1 when m > 1.75 (mantissa field > 0x600000). Equal to formats.ue8m0_encode for every
    finite float32 (checked exhaustively at powers of two and their neighbours in the tests)."""
    a = jnp.maximum(amax, jnp.float32(formats.AMAX_FLOOR))
    bits = lax.bitcast_convert_type(a, jnp.int32)
    byte = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
    byte = jnp.where(nonfinite, formats.UE8M0_NAN, jnp.clip(byte, 0, 254))
    inv = lax.bitcast_convert_type((254 - jnp.clip(byte, 1, 253)) << 23, jnp.float32)
    return byte, jnp.where(nonfinite, jnp.float32(jnp.nan), inv)


def _block_stats(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row max |x| and whether the row holds NaN or +-inf (max ignores NaN on the GPU)."""
    ax = jnp.abs(x)
    finite = (ax < jnp.inf).astype(jnp.int32)  # False for NaN and inf
    return jnp.max(ax, axis=1), jnp.min(finite, axis=1) == 0


def _quantize(x: jax.Array, inv: jax.Array, nonfinite: jax.Array) -> jax.Array:
    q = jnp.clip(x * inv[:, None], -formats.E4M3_MAX, formats.E4M3_MAX)
    return jnp.where(nonfinite[:, None], jnp.float32(jnp.nan), q).astype(jnp.float8_e4m3fn)


def _kv_write_kernel(
    slots_ref,  # [block_t] int32: flat rows of the whole (layer-flattened) pool, < 0 = none
    x_ref,  # [block_t, D] rows to write (fp32 or bf16)
    *refs,  # input planes (aliased, unused), output planes [rows, ...]
    fmt: str,  # "fp8_ds_mla" | "bf16" | "indexer_fp8"
    n_planes: int,
    nope: int,  # fp8_ds_mla: NoPE dims (64-wide quantisation blocks) before the RoPE dims
    width: int,  # column chunk of the other dims (64, or 32 / 16 for narrow planes)
):
    out = refs[n_planes:]
    block_t, dim = x_ref.shape
    slots = slots_ref[...]
    valid = slots >= 0
    rows = jnp.maximum(slots, 0)

    def tile(w):  # row and column indices, mask of a [block_t, w] store
        cols = lax.broadcasted_iota(jnp.int32, (block_t, w), 1)
        return jnp.broadcast_to(rows[:, None], (block_t, w)), cols, jnp.broadcast_to(valid[:, None], (block_t, w))

    def load(col, w, dtype=jnp.float32):
        return x_ref[:, pl.ds(col, w)].astype(dtype)

    if fmt == "fp8_ds_mla":
        nope_ref, rope_ref, scale_ref = out
        r2, c2, m2 = tile(DIM_CHUNK)
        n_scale = scale_ref.shape[1]
        scol = lax.broadcasted_iota(jnp.int32, (block_t, n_scale), 1)
        scale_tile = jnp.zeros((block_t, n_scale), jnp.int32)  # padding bytes stay 0
        for c in range(nope // DIM_CHUNK):
            x = load(c * DIM_CHUNK, DIM_CHUNK)
            amax, nonfinite = _block_stats(x)
            byte, inv = _ue8m0_byte_and_inverse(amax, nonfinite)
            plgpu.store(nope_ref.at[r2, c2 + c * DIM_CHUNK], _quantize(x, inv, nonfinite), mask=m2)
            scale_tile = jnp.where(scol == c, byte[:, None], scale_tile)
        plgpu.store(
            scale_ref.at[jnp.broadcast_to(rows[:, None], (block_t, n_scale)), scol],
            scale_tile.astype(jnp.uint8),
            mask=jnp.broadcast_to(valid[:, None], (block_t, n_scale)),
        )
        r2, c2, m2 = tile(width)
        for col in range(0, dim - nope, width):
            plgpu.store(rope_ref.at[r2, c2 + col], load(nope + col, width, jnp.bfloat16), mask=m2)
    elif fmt == "indexer_fp8":  # one scale for the whole key
        keys_ref, kscale_ref = out
        r2, c2, m2 = tile(width)
        xs = [load(col, width) for col in range(0, dim, width)]
        stats = [_block_stats(x) for x in xs]
        amax = functools.reduce(jnp.maximum, [st[0] for st in stats])
        nonfinite = functools.reduce(jnp.logical_or, [st[1] for st in stats])
        byte, inv = _ue8m0_byte_and_inverse(amax, nonfinite)
        for i, x in enumerate(xs):
            plgpu.store(keys_ref.at[r2, c2 + i * width], _quantize(x, inv, nonfinite), mask=m2)
        scale = lax.bitcast_convert_type(jnp.clip(byte, 1, 254) << 23, jnp.float32)
        plgpu.store(kscale_ref.at[rows], jnp.where(nonfinite, jnp.float32(jnp.nan), scale), mask=valid)
    else:  # plain bf16 rows (KV or indexer keys)
        (rows_ref,) = out
        r2, c2, m2 = tile(width)
        for col in range(0, dim, width):
            plgpu.store(rows_ref.at[r2, c2 + col], load(col, width, jnp.bfloat16), mask=m2)


# ---- wrapper ----------------------------------------------------------------------------------
def _write_format(planes: tuple[jax.Array, ...], width: int) -> str:
    """The format a pool stores rows of `width` dims in, told by its plane count and first plane's
    dtype: "fp8_ds_mla" (e4m3 nope, bf16 rope, uint8 scales), "indexer_fp8" (e4m3 keys, fp32
    scales), "bf16" (bf16 rows) or "float32" (float32 rows). ValueError when the rows do not fit
    the planes."""
    fmt = None
    if len(planes) in (2, 3) and planes[0].dtype == jnp.float8_e4m3fn:
        fmt = "fp8_ds_mla" if len(planes) == 3 else "indexer_fp8"
    elif len(planes) == 1 and planes[0].dtype in (jnp.bfloat16, jnp.float32):
        fmt = "bf16" if planes[0].dtype == jnp.bfloat16 else FLOAT32
    if fmt is None:
        raise ValueError(
            "a pool is (e4m3 nope, bf16 rope, uint8 scales), (e4m3 keys, fp32 scales), (bf16 rows,) or "
            f"(float32 rows,) planes, got {[(p.shape, str(p.dtype)) for p in planes]}"
        )
    pool_width = planes[0].shape[-1] + (planes[1].shape[-1] if fmt == "fp8_ds_mla" else 0)
    if pool_width != width:
        raise ValueError(f"rows of {width} dims do not fit this {fmt} pool, whose rows have {pool_width} dims")
    return fmt


def _write(planes, x, slots, layer, fmt, cfg, interpret):
    refuse_wrapping_offsets(planes)
    flat, blocks, units = flatten_pool(planes)
    per_layer = blocks * units
    t, dim = x.shape
    block_t = cfg.block_k
    slots = slots.astype(jnp.int32)
    ok = (slots >= 0) & (slots < per_layer)
    pad = -t % block_t
    if pad:
        slots = jnp.pad(slots, (0, pad))
        ok = jnp.pad(ok, (0, pad))
        x = jnp.pad(x, ((0, pad), (0, 0)))
    rows = jnp.asarray(layer, jnp.int32) * per_layer + slots
    # Skipped rows become copies of the first written row (see the module docstring).
    first = jnp.argmax(ok)
    any_ok = jnp.any(ok)
    rows = jnp.where(ok, rows, jnp.where(any_ok, rows[first], -1))
    x = jnp.where(ok[:, None], x, x[first][None, :])

    nope = planes[0].shape[-1] if fmt == "fp8_ds_mla" else 0
    if nope % DIM_CHUNK:
        raise ValueError(f"the fp8_ds_mla kernel needs the NoPE dims ({nope}) in multiples of {DIM_CHUNK}")
    n_planes = len(flat)
    kernel = functools.partial(
        _kv_write_kernel, fmt=fmt, n_planes=n_planes, nope=nope, width=chunk_width(dim - nope)
    )
    new = pl.pallas_call(
        kernel,
        grid=(x.shape[0] // block_t,),
        in_specs=[pl.BlockSpec((block_t,), lambda i: (i,)), pl.BlockSpec((block_t, dim), lambda i: (i, 0))]
        + [full_block(p) for p in flat],
        out_specs=[full_block(p) for p in flat],
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in flat],
        input_output_aliases={2 + i: i for i in range(n_planes)},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"kv_write_{fmt}",
    )(rows, x, *flat)
    return tuple(n.reshape(p.shape) for n, p in zip(new, planes))


@functools.partial(jax.jit, static_argnames=("config", "device_kind", "interpret"))
def write_kv(
    pool: tuple[jax.Array, ...],  # fp8_ds_mla (nope, rope, scales) or (bf16 rows,): [L, blocks, units, ...]
    kv: jax.Array,  # [T, head_dim] new K = V rows (fp32 or bf16)
    slots: jax.Array,  # [T] int32 flat slots (block * units + offset) of pool layer `layer`; < 0 = skip
    layer: int | jax.Array = 0,
    *,
    config: tuning.KernelConfig | None = None,
    device_kind: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Quantise `kv` into the pool's format and scatter it to `slots`; returns the new planes
    (the pool is updated in place when the caller donates it)."""
    pool = tuple(pool)
    fmt = kernel_format(_write_format(pool, kv.shape[-1]), "kv_write")
    if fmt == "indexer_fp8":
        raise ValueError("write_kv got an indexer key pool (2 planes); indexer keys go through write_indexer_keys")
    cfg = config or tuning.kernel_config("kv_write", device_kind, interpret=interpret)
    return _write(pool, kv, slots, layer, fmt, cfg, interpret)


@functools.partial(jax.jit, static_argnames=("config", "device_kind", "interpret"))
def write_indexer_keys(
    pool: tuple[jax.Array, ...],  # (e4m3 keys [L, blocks, units, d], fp32 scales [L, blocks, units]) or (bf16 keys,)
    keys: jax.Array,  # [T, d]
    slots: jax.Array,  # [T] int32 flat slots; < 0 = skip
    layer: int | jax.Array = 0,
    *,
    config: tuning.KernelConfig | None = None,
    device_kind: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Quantise indexer keys (one power-of-two scale per key) and scatter them to `slots`."""
    pool = tuple(pool)
    fmt = kernel_format(_write_format(pool, keys.shape[-1]), "kv_write")
    if fmt == "fp8_ds_mla":
        raise ValueError("write_indexer_keys got an fp8_ds_mla KV pool (3 planes); KV rows go through write_kv")
    cfg = config or tuning.kernel_config("kv_write", device_kind, interpret=interpret)
    return _write(pool, keys, slots, layer, fmt, cfg, interpret)


# ---- reference --------------------------------------------------------------------------------
@jax.jit
def write_kv_reference(
    pool: Any,  # a tuple of planes [L, blocks, units, ...] / [blocks, units, ...], or a pytree of them
    rows: jax.Array,  # [T, D] new K = V rows or indexer keys
    slots: jax.Array,  # [T] int32 flat slots of pool layer `layer`; < 0 or past the layer = skip
    layer: int | jax.Array = 0,
) -> Any:
    """Pure-JAX definition of `write_kv` and `write_indexer_keys`: quantise `rows` into the pool's
    format with formats.py (`_write_format` tells it from the plane count and dtype; float32 rows
    are stored exactly), then scatter. Returns the pool with the same structure (a tuple, or e.g.
    the cache's `Fp8DsMlaPlanes`)."""
    planes, structure = jax.tree.flatten(pool)
    fmt = _write_format(planes, rows.shape[-1])
    if fmt == "fp8_ds_mla":
        values = formats.fp8_ds_mla_quantize(rows, planes[1].shape[-1])
    elif fmt == "indexer_fp8":
        values = formats.indexer_fp8_quantize(rows)
    elif fmt == FLOAT32:
        values = (formats.float32_rows_quantize(rows),)
    else:
        values = (formats.bf16_rows_quantize(rows),)
    flat, blocks, units = flatten_pool(planes)
    per_layer = blocks * units
    slots = slots.astype(jnp.int32)
    # Skipped slots point past the last row of every plane (planes may differ in idle layers, see
    # formats.idle_layers): mode="drop" discards them.
    target = jnp.where(
        (slots >= 0) & (slots < per_layer), jnp.asarray(layer, jnp.int32) * per_layer + slots,
        max(f.shape[0] for f in flat),
    )
    new = [_set_rows(f, target, v).reshape(p.shape) for f, v, p in zip(flat, values, planes)]
    return jax.tree.unflatten(structure, new)


def _set_rows(flat: jax.Array, target: jax.Array, values: jax.Array) -> jax.Array:
    """`flat.at[target].set(values, mode="drop")`; a float8 plane is scattered as its bytes (the
    same bits): XLA:CPU scatters float8 by converting the whole plane to float16 and back, each
    layer's write; as bytes the copy is half as large (XLA:CPU still does not convert in place)."""
    if flat.dtype.itemsize == 1 and jnp.issubdtype(flat.dtype, jnp.floating):
        as_bytes = jax.lax.bitcast_convert_type(flat, jnp.uint8)
        written = as_bytes.at[target].set(jax.lax.bitcast_convert_type(values.astype(flat.dtype), jnp.uint8), mode="drop")
        return jax.lax.bitcast_convert_type(written, flat.dtype)
    return flat.at[target].set(values, mode="drop")
