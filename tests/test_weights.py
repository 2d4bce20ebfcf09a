"""Weight formats (spec 7.2): UE8M0 reinterpretation, FP8 block and MXFP4 dequantisation, the
numpy quantisers the checkpoint writer uses, and the device representation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4_jax.model import weight_formats as W


# ---- UE8M0 ----------------------------------------------------------------------------------
def test_e8m0_known_answers():
    got = W.e8m0_to_float32(np.array([120, 127, 128, 0, 1, 254, 255], np.uint8))
    assert got.dtype == np.float32
    assert got[0] == 2.0**-7
    assert got[1] == 1.0
    assert got[2] == 2.0
    assert got[3] == 2.0**-127
    assert got[4] == 2.0**-126
    assert got[5] == 2.0**127
    assert np.isnan(got[6])


def test_e8m0_all_bytes_match_ml_dtypes_and_jax():
    b = np.arange(256, dtype=np.uint8)
    ref = b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)  # ml_dtypes' bit semantics
    np_out = W.e8m0_to_float32(b)
    np.testing.assert_array_equal(np_out, ref)  # NaN == NaN for assert_array_equal
    jax_out = np.asarray(jax.jit(W.e8m0_to_float32)(jnp.asarray(b)))
    np.testing.assert_array_equal(jax_out[1:], ref[1:])
    assert jax_out[0] in (0.0, 2.0**-127)  # 2^-127 is subnormal: a device may flush it
    # float8_e8m0fnu arrays are read by their bytes too (numpy and jax).
    np.testing.assert_array_equal(W.e8m0_to_float32(b.view(ml_dtypes.float8_e8m0fnu)), ref)
    e8 = jnp.asarray(b[100:140].view(ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(np.asarray(W.e8m0_to_float32(e8)), ref[100:140])


def test_reinterpretation_differs_from_numeric_cast():
    byte = np.array([120], np.uint8)
    assert W.e8m0_to_float32(byte)[0] == 2.0**-7
    assert byte.astype(np.float32)[0] == 120.0  # the numeric cast: wrong
    # A numeric cast into the E8M0 type rounds 120 to 2^7 (byte 134) and loses the meaning.
    cast = byte.astype(ml_dtypes.float8_e8m0fnu)
    assert cast.view(np.uint8)[0] != 120 and cast.astype(np.float32)[0] == 128.0
    assert W.e8m0_to_float32(cast)[0] != 2.0**-7


# ---- MXFP4 ----------------------------------------------------------------------------------
def test_mxfp4_nibble_known_answer():
    # Byte 0x21: low nibble 1 -> 0.5 (element 0), high nibble 2 -> 1.0 (element 1).
    packed = np.full((1, 16), 0x21, np.uint8)
    out = np.asarray(W.dequantize_mxfp4(packed, np.array([[127]], np.uint8), jnp.float32))
    assert out.shape == (1, 32)
    np.testing.assert_array_equal(out[0, :2], [0.5, 1.0])
    np.testing.assert_array_equal(out[0], np.tile([0.5, 1.0], 16))
    # scale byte 120 multiplies by 2^-7; int8 storage reads the same bytes.
    out = np.asarray(W.dequantize_mxfp4(packed.view(np.int8), np.array([[120]], np.uint8), jnp.float32))
    np.testing.assert_array_equal(out[0, :2], [0.5 * 2.0**-7, 2.0**-7])


def test_mxfp4_full_code_table():
    codes = np.arange(16, dtype=np.uint8)
    packed = (codes | (codes[::-1] << 4)).astype(np.uint8)[None, :]  # [1, 16] -> 32 values
    out = W.dequantize_mxfp4_np(packed, np.array([[127]], np.uint8))[0]
    np.testing.assert_array_equal(out[0::2], W.E2M1_VALUES)
    np.testing.assert_array_equal(out[1::2], W.E2M1_VALUES[::-1])
    assert list(W.E2M1_VALUES) == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(W.E2M1_VALUES[8])


def test_mxfp4_round_trip_and_scales():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 64)).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 3, (6, 1))
    packed, scale = W.quantize_mxfp4(w)
    assert packed.shape == (6, 32) and packed.dtype == np.uint8
    assert scale.shape == (6, 2) and scale.dtype == np.uint8
    s = W.e8m0_to_float32(scale)
    amax = np.abs(w.reshape(6, 2, 32)).max(-1)
    assert np.all(amax / s <= 6.0) and np.all(amax / s > 3.0)  # smallest power of two that fits
    deq = W.dequantize_mxfp4_np(packed, scale)
    # E2M1 gaps are 0.5 / 1 / 2 on [0,2] / [2,4] / [4,6]: the error is at most half a gap.
    err = np.abs(deq - w).reshape(6, 2, 32) / s[..., None]
    mag = np.abs(w).reshape(6, 2, 32) / s[..., None]
    bound = np.where(mag <= 2, 0.25, np.where(mag <= 4, 0.5, 1.0))
    assert np.all(err <= bound)
    # Values already on the grid survive exactly; ties go to the even code.
    grid = (W.E2M1_VALUES[rng.integers(0, 16, (2, 32))] * 2.0**-3).astype(np.float32)
    grid[:, 0] = 6 * 2.0**-3
    np.testing.assert_array_equal(W.dequantize_mxfp4_np(*W.quantize_mxfp4(grid)), grid)
    ties = np.array([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0] + [0.0] * 23], np.float32)
    out = W.dequantize_mxfp4_np(*W.quantize_mxfp4(ties))[0, :9]
    np.testing.assert_array_equal(out, [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0])


# ---- FP8 blocks -----------------------------------------------------------------------------
def test_fp8_scale_grid_uses_ceil_division():
    w = np.random.default_rng(1).standard_normal((130, 200)).astype(np.float32)
    q, scale = W.quantize_fp8_blocks(w, (128, 128), "ue8m0")
    assert q.shape == (130, 200) and q.dtype == ml_dtypes.float8_e4m3fn
    assert scale.shape == (2, 2) and scale.dtype == np.uint8
    # Known answer on the partial blocks: ones times scale bytes 127, 128 / 129, 130.
    ones = np.ones((130, 200), ml_dtypes.float8_e4m3fn)
    scale = np.array([[127, 128], [129, 130]], np.uint8)
    out = np.asarray(W.dequantize_fp8_blocks(ones, scale, (128, 128), jnp.float32))
    assert out.shape == (130, 200)
    assert (out[0, 0], out[0, 199], out[129, 0], out[129, 199], out[127, 127], out[128, 128]) == (1, 2, 4, 8, 1, 8)
    with pytest.raises(ValueError, match="scale grid"):
        W.dequantize_fp8_blocks(ones, np.zeros((1, 2), np.uint8), (128, 128), jnp.float32)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_fp8_round_trip_within_format_bound(scale_fmt):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((130, 200)).astype(np.float32)
    w[:128, :128] *= 1e-3  # blocks of very different magnitude
    w[128:, 128:] *= 50.0
    q, scale = W.quantize_fp8_blocks(w, (128, 128), scale_fmt)
    s = W.e8m0_to_float32(scale) if scale_fmt else scale
    assert scale.dtype == (np.uint8 if scale_fmt else np.float32)
    s_full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:130, :200]
    deq = W.dequantize_fp8_blocks_np(q, scale)
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4; subnormal spacing 2^-9 -> 2^-10 absolute.
    assert np.all(np.abs(deq - w) <= 2.0**-4 * np.abs(w) + 2.0**-10 * s_full)
    # jax dequantisation gives the same numbers as the numpy reference.
    jax_deq = W.dequantize_fp8_blocks(q, scale, (128, 128), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax_deq), deq)


def test_ue8m0_scale_is_the_smallest_power_of_two():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 384)).astype(np.float32) * np.float32(10.0) ** rng.integers(-4, 4, (256, 1))
    w[:128, :128] = 0.0  # an all-zero block gets scale 1 (byte 127)
    _, scale = W.quantize_fp8_blocks(w, (128, 128), "ue8m0")
    s = W.e8m0_to_float32(scale)
    exp = np.log2(s)
    np.testing.assert_array_equal(exp, np.round(exp))  # a power of two
    assert scale[0, 0] == 127
    amax = np.abs(w).reshape(2, 128, 3, 128).max(axis=(1, 3))
    nz = amax > 0
    assert np.all(amax[nz] / s[nz] <= 448.0) and np.all(amax[nz] / s[nz] > 224.0)
    np.testing.assert_array_equal(exp[nz], np.ceil(np.log2(amax[nz] / 448.0)))


def test_jax_dequantisers_match_numpy_and_dispatch():
    rng = np.random.default_rng(4)
    experts = rng.standard_normal((3, 64, 96)).astype(np.float32)  # stacked [E, out, in]
    packed, scale = W.quantize_mxfp4(experts)
    ref = W.dequantize_mxfp4_np(packed, scale)
    np.testing.assert_array_equal(np.asarray(W.dequantize_mxfp4(packed, scale, jnp.float32)), ref)
    np.testing.assert_array_equal(np.asarray(W.dequantize_weight(packed.view(np.int8), scale, dtype=jnp.float32)), ref)
    bf16 = np.asarray(W.dequantize_mxfp4(packed, scale, jnp.bfloat16))
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bf16.astype(np.float32), ref)  # E2M1 x 2^k is exact in bf16
    q, s8 = W.quantize_fp8_blocks(experts, (32, 32), "ue8m0")
    np.testing.assert_array_equal(
        np.asarray(W.dequantize_weight(q, s8, (32, 32), jnp.float32)), W.dequantize_fp8_blocks_np(q, s8, (32, 32))
    )
    raw = q.view(np.uint8)  # E4M3 given as raw bytes is reinterpreted, not converted
    np.testing.assert_array_equal(
        np.asarray(W.dequantize_fp8_blocks(raw, s8, (32, 32), jnp.float32)), W.dequantize_fp8_blocks_np(q, s8, (32, 32))
    )
    plain = experts.astype(ml_dtypes.bfloat16)
    assert W.dequantize_weight(plain, None, dtype=jnp.float32).dtype == jnp.float32


# ---- device representation ------------------------------------------------------------------
def test_device_dtype_mapping():
    assert W.device_dtype("F8_E4M3") == np.dtype(ml_dtypes.float8_e4m3fn)
    assert W.device_dtype("F8_E8M0") == np.uint8
    assert W.device_dtype("F32") == np.float32
    assert W.device_dtype("BF16") == np.dtype(ml_dtypes.bfloat16)
    assert W.device_dtype("I8") == np.uint8
    assert W.device_dtype("I64") == np.int32
    with pytest.raises(ValueError, match="unsupported"):
        W.device_dtype("F4")
    e8 = np.array([120, 255], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(W.to_device_representation(e8, "F8_E8M0"), [120, 255])
    i8 = np.array([-15, 33], np.int8)
    np.testing.assert_array_equal(W.to_device_representation(i8, "I8"), [0xF1, 33])
    ids = W.to_device_representation(np.array([[0, 7]], np.int64), "I64")
    assert ids.dtype == np.int32
    with pytest.raises(ValueError, match="range"):
        W.to_device_representation(np.array([2**40], np.int64), "I64")
