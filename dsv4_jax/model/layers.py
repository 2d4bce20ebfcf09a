"""Building blocks: RMSNorm and linears that keep the checkpoint's storage format.

A linear holds `weight` exactly as the checkpoint stores it ([out, in]: bf16/f32, or FP8 E4M3
with a `scale` block grid of UE8M0 bytes or f32) and dequantises inside the jitted forward,
per use, so no dequantised copy of a weight ever lives on the device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax import weights as wfmt
from dsv4_jax.config import DeepseekV4Config, num_blocks
from dsv4_jax.sharding import EMBED, NORM, VOCAB

# Placeholder dtype of tensors DeepSeek stores in bf16 (the abstract model's shapes and dtypes);
# loading takes whatever dtype the checkpoint file has (transformers saves float32).
STORED_DTYPE = jnp.bfloat16

# Rows up to which `Linear.float32` multiplies a bf16 weight as stored (three bf16 slices of x)
# rather than converting the whole weight for the call (GPUs; the slices triple the FLOPs).
SLICED_MAX_ROWS = 32
# The same where a float32 copy of the weight exists (`weight_float32`, CPUs): up to 63 matmul
# rows, as XLA:CPU's bf16 dot is fast up to 64 rows and leaves its fast path above (129280 x 128
# head, 2026-12-01: 64 rows 2.8 ms, 65 rows 12.6 ms); more rows read the copy.
SLICED_MAX_ROWS_BESIDE_FLOAT32 = 21


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) in float32 (no weight)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), STORED_DTYPE), axes=(NORM,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (self.weight[...].astype(jnp.float32) * rms_normalize(x, self.eps)).astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ W^T with W [out, in] in the checkpoint's format; `quantized` selects FP8 blocks.
    `axes` are the logical axis names (`dsv4_jax.sharding`) of [out, in]; the block scales
    carry the same names, so they split along the same mesh axes as the weight (None: undeclared,
    which `sharding.partition_spec` refuses; only standalone test linears leave it out)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        config: DeepseekV4Config,
        quantized: bool,
        axes: tuple[str, str] | None = None,
    ):
        self.quantized = quantized and config.quantized
        if self.quantized:
            bo, bi = config.quantization.weight_block_size
            scale_dtype = jnp.uint8 if config.quantization.scale_fmt == "ue8m0" else jnp.float32
            self.block = (bo, bi)
            self.weight = nnx.Param(jnp.zeros((out_features, in_features), jnp.float8_e4m3fn), axes=axes)
            self.scale = nnx.Param(
                jnp.zeros((num_blocks(out_features, bo), num_blocks(in_features, bi)), scale_dtype), axes=axes
            )
        else:
            self.weight = nnx.Param(jnp.zeros((out_features, in_features), STORED_DTYPE), axes=axes)

    def dequantized(self, dtype) -> jax.Array:  # [out, in]
        if self.quantized:
            return wfmt.dequantize_fp8_blocks(self.weight[...], self.scale[...], self.block, dtype)
        return self.weight[...].astype(dtype)

    def __call__(self, x: jax.Array, dtype=None) -> jax.Array:
        dtype = dtype or x.dtype
        return jnp.einsum("...i,oi->...o", x.astype(dtype), self.dequantized(dtype))

    def float32(self, x: jax.Array) -> jax.Array:
        """x [..., in] -> x @ W^T [..., out] in float32. For the vocabulary head: with a bf16
        weight and a few rows (decode steps, the last token of each row) it reads the weight as
        stored (`float32_matmul_bf16`) instead of converting all of it on every call; with more
        rows it reads `weight_float32` where loading kept one (CPUs, `loading._add_float32_head`)."""
        weight = self.weight[...]
        if not self.quantized and weight.dtype == jnp.bfloat16:
            copy = getattr(self, "weight_float32", None)
            if math.prod(x.shape[:-1]) <= (SLICED_MAX_ROWS if copy is None else SLICED_MAX_ROWS_BESIDE_FLOAT32):
                return float32_matmul_bf16(x.astype(jnp.float32), weight)
            if copy is not None:
                return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), copy[...])
        return self(x, jnp.float32)


def float32_matmul_bf16(
    x: jax.Array,  # [..., in] float32
    weight: jax.Array,  # [out, in] bfloat16
) -> jax.Array:  # [..., out] float32: x @ weight^T as a float32 matmul computes it
    """The float32 product with a bf16 weight, without converting the weight.

    Converting first materialises a float32 copy of the whole weight on every call (XLA:CPU does
    not fuse the convert into the dot): for the 129280 x 128 vocabulary head that copy was most
    of a decode step (~40 of ~50 ms on 2 busy cores). Instead x is split into three bf16 slices
    (hi + mid + lo = x to float32 precision) and one bf16 matmul with float32 accumulation
    multiplies all three by the weight as stored: bf16 x bf16 products are exact in float32, so
    the result matches the float32 matmul to float32 rounding (summation order)."""
    slices, rest = [], x
    for _ in range(3):
        piece = rest.astype(jnp.bfloat16)
        slices.append(piece)
        rest = rest - piece.astype(jnp.float32)
    y = jax.lax.dot_general(
        jnp.stack(slices), weight, (((x.ndim,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    return y[0] + y[1] + y[2]


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int):
        self.weight = nnx.Param(jnp.zeros((vocab_size, dim), STORED_DTYPE), axes=(VOCAB, EMBED))

    def __call__(self, token_ids: jax.Array, dtype) -> jax.Array:
        return self.weight[...][token_ids].astype(dtype)
