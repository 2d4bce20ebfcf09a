"""KV-cache storage formats (pallas_kernels/formats.py): byte counts, the spec 8.2 rule, special
values, and bit-for-bit agreement with the model's KV rounding (dsv4_jax/model/kv_rounding.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from dsv4_jax.model import kv_rounding
from pallas_kernels import formats as F

HEAD, ROPE = 512, 64  # DeepSeek-V4-Flash
NOPE = HEAD - ROPE
E4M3_CODES = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=np.uint8)  # all but NaN

quantize = jax.jit(F.fp8_ds_mla_quantize, static_argnums=1)
dequantize = jax.jit(F.fp8_ds_mla_dequantize, static_argnums=3)
idx_quantize = jax.jit(F.indexer_fp8_quantize)
kv_round_trip = jax.jit(kv_rounding.kv_cache_round_trip, static_argnums=1)


def fp8_round_trip(x: np.ndarray, rope: int = ROPE) -> tuple[np.ndarray, np.ndarray]:
    nope, r, scales = quantize(jnp.asarray(x), rope)
    return np.asarray(dequantize(nope, r, scales, jnp.float32)), np.asarray(scales)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


# ---- byte counts ---------------------------------------------------------------------------------
def test_byte_counts():
    assert F.FP8_DS_MLA_QUANT_BLOCK == 64
    assert F.fp8_ds_mla_scale_bytes(448) == 8  # 7 scale bytes + 1 padding byte
    assert [F.fp8_ds_mla_scale_bytes(n) for n in (0, 64, 512, 513, 1024)] == [8, 8, 8, 16, 16]
    assert F.fp8_ds_mla_bytes_per_token(512, 64) == 584 == 448 + 2 * 64 + 8
    assert F.fp8_ds_mla_bytes_per_token(96, 32) == 64 + 64 + 8  # the tiny test model
    assert F.bf16_bytes_per_token(512) == 1024
    assert F.indexer_fp8_bytes_per_entry(128) == 132
    assert F.indexer_bf16_bytes_per_entry(128) == 256
    assert F.float32_bytes_per_token(512) == 2048 and F.float32_bytes_per_token(96) == 384
    assert F.indexer_float32_bytes_per_entry(128) == 512
    for bad in (lambda: F.fp8_ds_mla_bytes_per_token(64, 128), lambda: F.bf16_bytes_per_token(0),
                lambda: F.fp8_ds_mla_scale_bytes(-1), lambda: F.float32_bytes_per_token(0),
                lambda: F.indexer_float32_bytes_per_entry(-4)):
        with pytest.raises(ValueError):
            bad()


def test_planes_shapes_and_dtypes():
    x = jnp.zeros((2, 3, HEAD), jnp.bfloat16)
    nope, rope, scales = quantize(x, ROPE)
    assert (nope.shape, nope.dtype) == ((2, 3, NOPE), jnp.float8_e4m3fn)
    assert (rope.shape, rope.dtype) == ((2, 3, ROPE), jnp.bfloat16)
    assert (scales.shape, scales.dtype) == ((2, 3, 8), jnp.uint8)
    assert F.fp8_ds_mla_dequantize(nope, rope, scales, jnp.bfloat16).dtype == jnp.bfloat16


# ---- agreement with the model's KV rounding ---------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_dequantised_equals_kv_rounding_bit_for_bit(dtype):
    # Block maxima between about 0.06 and 200 (scale exponents in [-12, 12]); the whole range is
    # covered by the next test.
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(8, HEAD)) * s for s in (0.05, 1.0, 20.0)]).astype(dtype)
    nope, rope, scales = quantize(jnp.asarray(x), ROPE)
    assert set(np.unique(np.asarray(scales)[:, :7])) <= set(range(127 - 12, 127 + 13))
    ours = dequantize(nope, rope, scales, jnp.dtype(dtype))
    ref = kv_round_trip(jnp.asarray(x), ROPE)
    np.testing.assert_array_equal(bits(ours), bits(ref))

    keys = x[:, :128]
    q, scale = idx_quantize(jnp.asarray(keys))
    ours = F.indexer_fp8_dequantize(q, scale, jnp.dtype(dtype))
    np.testing.assert_array_equal(bits(ours), bits(kv_rounding.indexer_key_round_trip(jnp.asarray(keys))))


def test_kv_rounding_matches_over_the_whole_range():
    # Regression: the KV rounding once took exp2(ceil(log2(...))), inexact on XLA:CPU (exp2(-22) != 2**-22).
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=(4, HEAD)) * s for s in (1e-5, 1e-3, 1e3, 1e6)]).astype(np.float32)
    ours, _ = fp8_round_trip(x)
    np.testing.assert_array_equal(bits(ours), bits(kv_round_trip(jnp.asarray(x), ROPE)))


# ---- the spec 8.2 rule, on drawn values -------------------------------------------------------------
finite = st.floats(-3e4, 3e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, (2, HEAD), elements=finite))
def test_round_trip_within_bound_and_scales_are_powers_of_two(x):
    y, scales = fp8_round_trip(x)
    blocks = np.abs(x[:, :NOPE]).reshape(2, 7, 64).max(-1)
    exponent = scales[:, :7].astype(np.int64) - 127
    assert (scales[:, 7] == 0).all()  # padding byte
    # scale = 2^ceil(log2(max(amax, 1e-4) / 448)), an exact power of two
    want = np.ceil(np.log2(np.maximum(blocks, 1e-4).astype(np.float64) / 448.0))
    expected_ok = (exponent == want) | np.isclose(np.maximum(blocks, 1e-4) / 448.0, 2.0 ** exponent, rtol=1e-6)
    assert expected_ok.all()
    scale = np.repeat(np.ldexp(1.0, exponent), 64, axis=-1)
    err = np.abs(y[:, :NOPE].astype(np.float64) - x[:, :NOPE])
    # e4m3: 3 mantissa bits (half-ulp 2^-4 relative), subnormal step 2^-9 (half: 2^-10) times the scale
    assert (err <= np.maximum(np.abs(x[:, :NOPE]) * 2.0**-4, scale * 2.0**-10)).all()
    # bf16 rope: half an ulp relative; XLA flushes float32 subnormals (< 2^-126) to zero.
    assert (np.abs(y[:, NOPE:] - x[:, NOPE:]) <= np.abs(x[:, NOPE:]) * 2.0**-8 + 2.0**-126).all()
    again, _ = fp8_round_trip(y)  # values already on the grid come back exactly
    np.testing.assert_array_equal(again, y)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from(E4M3_CODES.tolist()), min_size=2 * NOPE, max_size=2 * NOPE),
    st.lists(st.integers(-22, 118), min_size=14, max_size=14),
)
def test_values_on_the_grid_are_exact(codes, exponents):
    q = np.array(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(2, 7, 64)
    nope = (q * np.ldexp(1.0, np.array(exponents).reshape(2, 7, 1))).reshape(2, NOPE).astype(np.float32)
    x = np.concatenate([nope, np.ones((2, ROPE), np.float32)], axis=-1)
    y, _ = fp8_round_trip(x)
    np.testing.assert_array_equal(y, x)


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, (3, 128), elements=finite))
def test_indexer_keys(keys):
    q, scale = idx_quantize(jnp.asarray(keys))
    scale = np.asarray(scale)
    assert q.dtype == jnp.float8_e4m3fn and scale.dtype == np.float32
    mantissa, _ = np.frexp(scale)
    assert (mantissa == 0.5).all()  # powers of two
    y = np.asarray(F.indexer_fp8_dequantize(q, scale))
    err = np.abs(y.astype(np.float64) - keys)
    assert (err <= np.maximum(np.abs(keys) * 2.0**-4, scale[:, None] * 2.0**-10)).all()


def test_bf16_rows():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, HEAD)), jnp.float32)
    rows = F.bf16_rows_quantize(x)
    assert rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(F.bf16_rows_dequantize(rows, jnp.float32), x.astype(jnp.bfloat16).astype(jnp.float32))


def test_float32_rows_are_exact():
    # every float32 bit pattern class survives: normals, subnormals, -0.0, +-inf, NaN, the extremes
    x = np.random.default_rng(3).normal(size=(2, HEAD)).astype(np.float32)
    x[1, :8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, np.finfo(np.float32).max, -np.finfo(np.float32).tiny]
    rows = F.float32_rows_quantize(jnp.asarray(x))
    assert rows.dtype == jnp.float32
    np.testing.assert_array_equal(bits(rows), bits(x))
    np.testing.assert_array_equal(bits(F.float32_rows_dequantize(rows)), bits(x))
    b16 = jnp.asarray(x, jnp.bfloat16)  # bf16 input widens exactly
    np.testing.assert_array_equal(bits(F.float32_rows_quantize(b16)), bits(np.asarray(b16).astype(np.float32)))


# ---- special values ---------------------------------------------------------------------------------
def test_zeros_tiny_huge_nan_inf_have_documented_results():
    x = np.ones((6, HEAD), np.float32)
    x[0] = 0.0
    x[0, 1] = -0.0
    x[1, :64] = 2.0**-33  # block amax below the 1e-4 floor: scale 2^-22, 2^-33 / 2^-22 flushes to 0
    x[1, 64:128] = 2.0**-31  # the smallest e4m3 subnormal at that scale: kept exactly
    x[2, :64] = 1e38  # huge but representable
    x[2, 64] = 3.3e38  # > 240 * 2^120: rounds to 256 * 2^120 = 2^128, decodes to inf
    x[3, 5] = np.nan
    x[3, 200] = np.inf
    x[4, 70] = -np.inf
    x[5, NOPE:] = [np.nan, np.inf, -np.inf, 3.4e38] + [1.0] * (ROPE - 4)
    y, scales = fp8_round_trip(x)
    assert (scales[:, :7] >= 105).all()  # never below 2^-22

    assert (scales[0, :7] == 127 - 22).all() and (y[0, :NOPE] == 0).all()
    assert np.signbit(y[0, 1]) and not np.signbit(y[0, 0])  # -0.0 keeps its sign
    assert (y[1, :64] == 0).all() and (y[1, 64:128] == 2.0**-31).all()
    assert scales[2, 0] == 127 + 118 and np.allclose(y[2, 1:64], 1e38, rtol=2**-4)
    assert scales[2, 1] == 127 + 120 and y[2, 64] == np.inf and np.isfinite(y[2, 65:128]).all()

    # a block holding NaN or +-inf: scale byte 0xFF, the whole block NaN, other blocks untouched
    assert scales[3, 0] == 0xFF and scales[3, 3] == 0xFF and scales[4, 1] == 0xFF
    assert np.isnan(y[3, :64]).all() and np.isnan(y[3, 192:256]).all() and np.isnan(y[4, 64:128]).all()
    assert (y[3, 64:192] == 1).all() and (y[4, :64] == 1).all() and (y[3, NOPE:] == 1).all()
    # rope dims are a plain bf16 cast
    assert np.isnan(y[5, NOPE]) and y[5, NOPE + 1] == np.inf and y[5, NOPE + 2] == -np.inf
    assert y[5, NOPE + 3] == np.inf  # above bf16's largest finite value

    keys = np.ones((3, 128), np.float32)
    keys[0] = 0.0
    keys[1, 3] = np.nan
    keys[2, 4] = -np.inf
    q, scale = idx_quantize(jnp.asarray(keys))
    back = np.asarray(F.indexer_fp8_dequantize(q, scale))
    assert scale[0] == 2.0**-22 and (back[0] == 0).all()
    assert np.isnan(scale[1:]).all() and np.isnan(back[1:]).all()


def test_scale_byte_decoding():
    decoded = np.asarray(F.ue8m0_decode(jnp.arange(256, dtype=jnp.uint8)))
    np.testing.assert_array_equal(decoded[:255], np.ldexp(np.float32(1), np.arange(255) - 127).astype(np.float32))
    assert np.isnan(decoded[255])


def test_non_multiple_of_64_nope():
    x = np.random.default_rng(3).normal(size=(2, 100 + 16)).astype(np.float32)  # nope 100: 2 blocks
    y, scales = fp8_round_trip(x, rope=16)
    assert scales.shape == (2, 8) and (scales[:, 2:] == 0).all()
    assert np.allclose(y, x, rtol=2**-4, atol=2**-10)
