"""Weight storage formats of DeepSeek-V4 checkpoints (spec 7.2) and their device representation.

Formats:

* FP8 block linears: `weight` E4M3 [out, in] plus `scale` [ceil(out/128), ceil(in/128)], either
  UE8M0 bytes (`F8_E8M0`, byte b means 2^(b-127), 255 is NaN) or float32 (Base checkpoints).
  W[i, j] = e4m3(Wq[i, j]) * S[i // 128, j // 128].
* MXFP4 routed experts: `weight` I8 [out, in/2], byte k of a row holds element 2k in its low
  nibble and 2k+1 in its high nibble, each nibble an E2M1 code (bit 3 = sign); `scale` UE8M0
  [out, in/32]. W[i, j] = e2m1(i, j) * 2^(S[i, j // 32] - 127).

Device representation (what the loader hands to the model, and what stays on device): FP8
weights stay `float8_e4m3fn`, UE8M0 scales stay `uint8` (the raw bytes), float32 scales stay
float32, MXFP4 packed weights become `uint8`, `tid2eid` becomes int32, bf16/f32 stay as stored.
The forward dequantises per use with the jnp functions below (jit-able, static shapes).

UE8M0 bytes are always *reinterpreted* as a power of two, never numerically cast: a numeric
cast of byte 120 gives 120.0, or rounds 120 to 2^7; the stored meaning is 2^-7.

The numpy quantisers at the end are what `dsv4_jax.testing` uses to write quantized checkpoints.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_E4M3_MAX = 448.0
MXFP4_BLOCK = 32
E2M1_MAX = 6.0
DEFAULT_BLOCK = (128, 128)

# E2M1 code -> value; bit 3 is the sign (code 8 is -0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)

# safetensors dtype string -> numpy dtype of the bytes as stored in the file (ml_dtypes for the
# types numpy lacks). The reader views memory-mapped file bytes with these.
FILE_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}

# Where the device representation differs from the file's: UE8M0 scales as raw bytes, packed
# MXFP4 nibbles as unsigned bytes, 64-bit indices as int32 (JAX runs with x64 off).
_DEVICE_OVERRIDES: dict[str, np.dtype] = {
    "F8_E8M0": np.dtype(np.uint8),
    "I8": np.dtype(np.uint8),
    "I64": np.dtype(np.int32),
    "U64": np.dtype(np.uint32),
    "F64": np.dtype(np.float32),
}


def file_dtype(safetensors_dtype: str) -> np.dtype:
    """numpy dtype of a tensor's bytes as stored in a safetensors file."""
    try:
        return FILE_DTYPES[safetensors_dtype]
    except KeyError:
        raise ValueError(f"unsupported safetensors dtype {safetensors_dtype!r}") from None


def device_dtype(safetensors_dtype: str) -> np.dtype:
    """numpy dtype a tensor stored as `safetensors_dtype` has on device (see module docstring)."""
    return _DEVICE_OVERRIDES.get(safetensors_dtype, file_dtype(safetensors_dtype))


def to_device_representation(array: np.ndarray, safetensors_dtype: str) -> np.ndarray:
    """A tensor as read from the file (dtype `file_dtype(...)`) -> its device representation.

    Byte reinterpretations are views (no copy); I64 -> int32 checks the range first."""
    target = device_dtype(safetensors_dtype)
    if array.dtype == target:
        return array
    if safetensors_dtype in ("F8_E8M0", "I8"):
        return array.view(target)
    if safetensors_dtype in ("I64", "U64"):
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise ValueError(f"{safetensors_dtype} tensor has values outside {target} range")
    return array.astype(target)


# ---------------------------------------------------------------------------------------------
# UE8M0
# ---------------------------------------------------------------------------------------------
def _is_numpy(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, int, list, tuple))


def e8m0_to_float32(bytes_u8):
    """UE8M0 bytes -> float32 2^(b-127) by bit construction (b = 255 -> NaN, b = 0 -> 2^-127).

    Accepts uint8/int8 bytes or `float8_e8m0fnu` arrays (their bytes are used, never their
    numeric value converted through another type). numpy in -> numpy out; jax in -> jax out
    (jit-able)."""
    if _is_numpy(bytes_u8):
        b = np.asarray(bytes_u8)
        if b.dtype != np.uint8:
            if b.dtype.itemsize != 1:
                raise TypeError(f"UE8M0 scales must be 1-byte values, got {b.dtype}")
            b = b.view(np.uint8)
        bits = b.astype(np.uint32) << np.uint32(23)
        bits = np.where(b == 0, np.uint32(0x00400000), bits)
        bits = np.where(b == 255, np.uint32(0x7FC00000), bits)
        return bits.view(np.float32)
    b = bytes_u8
    if b.dtype != jnp.uint8:
        if jnp.dtype(b.dtype).itemsize != 1:
            raise TypeError(f"UE8M0 scales must be 1-byte values, got {b.dtype}")
        b = jax.lax.bitcast_convert_type(b, jnp.uint8)
    bits = b.astype(jnp.uint32) << 23
    bits = jnp.where(b == 0, jnp.uint32(0x00400000), bits)
    bits = jnp.where(b == 255, jnp.uint32(0x7FC00000), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _scale_to_float32(scale):
    """A scale grid in either storage (UE8M0 bytes, float8_e8m0fnu, or float32) -> float32 (jnp)."""
    if jnp.dtype(scale.dtype).itemsize == 1:
        return e8m0_to_float32(jnp.asarray(scale))
    return jnp.asarray(scale).astype(jnp.float32)


def _expand(scale: jax.Array, rows: int, cols: int, block_rows: int, block_cols: int) -> jax.Array:
    """Repeat a block grid [..., gr, gc] to element resolution [..., rows, cols] (cropping)."""
    s = jnp.repeat(scale, block_rows, axis=-2, total_repeat_length=scale.shape[-2] * block_rows)
    s = jnp.repeat(s, block_cols, axis=-1, total_repeat_length=scale.shape[-1] * block_cols)
    return s[..., :rows, :cols]


# ---------------------------------------------------------------------------------------------
# Dequantisation (jnp, jit-able; leading batch dims allowed, e.g. stacked experts)
# ---------------------------------------------------------------------------------------------
def dequantize_fp8_blocks(weight_e4m3, scale, block=DEFAULT_BLOCK, dtype=jnp.bfloat16) -> jax.Array:
    """E4M3 weight [..., out, in] x block scales [..., ceil(out/bo), ceil(in/bi)] -> `dtype`.

    `weight_e4m3` is `float8_e4m3fn` (or its raw bytes as uint8); `scale` is UE8M0 bytes
    (uint8 / float8_e8m0fnu) or float32. Jitted (inlined when called inside a jit)."""
    return _dequantize_fp8_blocks(weight_e4m3, scale, (int(block[0]), int(block[1])), dtype)


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def _dequantize_fp8_blocks(weight_e4m3, scale, block, dtype) -> jax.Array:
    w = jnp.asarray(weight_e4m3)
    if w.dtype == jnp.uint8:
        w = jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn)
    bo, bi = block
    rows, cols = w.shape[-2:]
    grid = (math.ceil(rows / bo), math.ceil(cols / bi))
    if tuple(scale.shape[-2:]) != grid:
        raise ValueError(
            f"fp8 scale grid {tuple(scale.shape)} does not match weight {tuple(w.shape)} with block "
            f"{tuple(block)}: expected [..., {grid[0]}, {grid[1]}]"
        )
    s = _expand(_scale_to_float32(scale), rows, cols, bo, bi)
    return (w.astype(jnp.float32) * s).astype(dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_mxfp4(packed, scale_u8, dtype=jnp.bfloat16) -> jax.Array:
    """Packed E2M1 [..., out, in/2] (uint8 or int8) x UE8M0 scales [..., out, in/32] -> [..., out, in].

    Jitted (inlined when called inside a jit)."""
    p = jnp.asarray(packed)
    if p.dtype != jnp.uint8:
        p = jax.lax.bitcast_convert_type(p, jnp.uint8)
    rows, half = p.shape[-2:]
    cols = 2 * half
    if cols % MXFP4_BLOCK or tuple(scale_u8.shape[-2:]) != (rows, cols // MXFP4_BLOCK):
        raise ValueError(
            f"mxfp4 scale {tuple(scale_u8.shape)} does not match packed weight {tuple(p.shape)}: "
            f"expected [..., {rows}, {cols // MXFP4_BLOCK}]"
        )
    table = jnp.asarray(E2M1_VALUES)
    lo = table[(p & 0x0F).astype(jnp.int32)]
    hi = table[(p >> 4).astype(jnp.int32)]
    values = jnp.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], cols)  # low nibble = even element
    s = jnp.repeat(_scale_to_float32(scale_u8), MXFP4_BLOCK, axis=-1, total_repeat_length=cols)
    return (values * s).astype(dtype)


def dequantize_weight(weight, scale=None, block=DEFAULT_BLOCK, dtype=jnp.bfloat16) -> jax.Array:
    """Dispatch on the device representation: uint8/int8 -> MXFP4, float8_e4m3fn -> FP8 blocks,
    anything else (bf16/f32, no scale) -> cast."""
    dt = jnp.dtype(weight.dtype)
    if dt in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.int8)):
        return dequantize_mxfp4(weight, scale, dtype)
    if dt == jnp.dtype(jnp.float8_e4m3fn):
        return dequantize_fp8_blocks(weight, scale, block, dtype)
    return jnp.asarray(weight).astype(dtype)


# ---------------------------------------------------------------------------------------------
# numpy reference dequantisers (writer, tests) and quantisers
# ---------------------------------------------------------------------------------------------
def _np_scale_to_float32(scale: np.ndarray) -> np.ndarray:
    scale = np.asarray(scale)
    return e8m0_to_float32(scale) if scale.dtype.itemsize == 1 else scale.astype(np.float32)


def dequantize_fp8_blocks_np(weight_e4m3: np.ndarray, scale: np.ndarray, block=DEFAULT_BLOCK) -> np.ndarray:
    """numpy float32 twin of `dequantize_fp8_blocks`."""
    w = np.asarray(weight_e4m3)
    if w.dtype == np.uint8:
        w = w.view(ml_dtypes.float8_e4m3fn)
    rows, cols = w.shape[-2:]
    s = _np_scale_to_float32(scale)
    s = np.repeat(np.repeat(s, block[0], axis=-2), block[1], axis=-1)[..., :rows, :cols]
    return w.astype(np.float32) * s


def dequantize_mxfp4_np(packed: np.ndarray, scale_u8: np.ndarray) -> np.ndarray:
    """numpy float32 twin of `dequantize_mxfp4`."""
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        p = p.view(np.uint8)
    values = np.stack([E2M1_VALUES[p & 0x0F], E2M1_VALUES[p >> 4]], axis=-1).reshape(*p.shape[:-1], -1)
    return values * np.repeat(_np_scale_to_float32(scale_u8), MXFP4_BLOCK, axis=-1)


def _ceil_log2(x: np.ndarray) -> np.ndarray:
    """Exact ceil(log2(x)) for positive finite float32/64 x (via frexp, no log rounding)."""
    mant, exp = np.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1)
    return np.where(mant == 0.5, exp - 1, exp).astype(np.int32)


def _pow2_scale_bytes(amax: np.ndarray, qmax: float) -> np.ndarray:
    """UE8M0 byte of the smallest power of two s with amax / s <= qmax (byte 127 for amax 0)."""
    amax = np.asarray(amax, np.float64)
    safe = np.where(amax > 0, amax / qmax, 1.0)
    e = np.clip(_ceil_log2(safe), -127, 127)
    return (e + 127).astype(np.uint8)


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    rows, cols = w.shape[-2:]
    bo, bi = block
    gr, gc = math.ceil(rows / bo), math.ceil(cols / bi)
    padded = np.zeros((*w.shape[:-2], gr * bo, gc * bi), np.float32)
    padded[..., :rows, :cols] = np.abs(w)
    return padded.reshape(*w.shape[:-2], gr, bo, gc, bi).max(axis=(-3, -1))


def quantize_fp8_blocks(w: np.ndarray, block=DEFAULT_BLOCK, scale_fmt: str | None = "ue8m0"):
    """float [..., out, in] -> (float8_e4m3fn [..., out, in], scale [..., ceil(out/bo), ceil(in/bi)]).

    scale_fmt "ue8m0": scale = 2^ceil(log2(amax / 448)) returned as UE8M0 bytes (uint8);
    None: scale = amax / 448 as float32. All-zero blocks get scale 1."""
    w = np.asarray(w, np.float32)
    if w.ndim < 2:
        raise ValueError(f"quantize_fp8_blocks needs [..., out, in], got shape {w.shape}")
    block = (int(block[0]), int(block[1]))
    amax = _block_amax(w, block)
    if scale_fmt == "ue8m0":
        scale = _pow2_scale_bytes(amax, FP8_E4M3_MAX)
        scale_f32 = e8m0_to_float32(scale)
    elif scale_fmt is None:
        scale = np.where(amax > 0, amax / np.float32(FP8_E4M3_MAX), np.float32(1.0)).astype(np.float32)
        scale_f32 = scale
    else:
        raise ValueError(f"scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    rows, cols = w.shape[-2:]
    s = np.repeat(np.repeat(scale_f32, block[0], axis=-2), block[1], axis=-1)[..., :rows, :cols]
    q = np.clip(w / s, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


# Midpoints between consecutive E2M1 magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6].
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


def quantize_mxfp4(w: np.ndarray):
    """float [..., out, in] (in % 32 == 0) -> (packed uint8 [..., out, in/2], UE8M0 uint8 [..., out, in/32]).

    Per 32 elements a power-of-two scale 2^ceil(log2(amax / 6)) (no clipping), then each
    element rounds to the nearest E2M1 value (ties to the even code); low nibble = even element."""
    w = np.asarray(w, np.float32)
    if w.ndim < 2 or w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"quantize_mxfp4 needs [..., out, in] with in % 32 == 0, got shape {w.shape}")
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = _pow2_scale_bytes(np.abs(groups).max(axis=-1), E2M1_MAX)
    y = groups / e8m0_to_float32(scale)[..., None]
    mag = np.minimum(np.abs(y), E2M1_MAX)
    lo = np.searchsorted(_E2M1_MIDPOINTS, mag, side="left")
    hi = np.searchsorted(_E2M1_MIDPOINTS, mag, side="right")
    idx = np.where((lo != hi) & (lo % 2 == 1), hi, lo)  # on a tie keep the even code
    codes = (idx | np.where((y < 0) & (idx != 0), 8, 0)).astype(np.uint8).reshape(w.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale
