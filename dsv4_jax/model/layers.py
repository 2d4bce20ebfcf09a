"""Building blocks: RMSNorm and linears that keep the checkpoint's storage format.

A linear holds `weight` exactly as the checkpoint stores it ([out, in]: bf16/f32, or FP8 E4M3
with a `scale` block grid of UE8M0 bytes or f32) and dequantises inside the jitted forward,
per use, so no dequantised copy of a weight ever lives on the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax import weights as wfmt
from dsv4_jax.config import DeepseekV4Config, num_blocks

# Placeholder dtype of tensors DeepSeek stores in bf16 (the abstract model's shapes and dtypes);
# loading takes whatever dtype the checkpoint file has (transformers saves float32).
STORED_DTYPE = jnp.bfloat16


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) in float32 (no weight)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), STORED_DTYPE))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (self.weight[...].astype(jnp.float32) * rms_normalize(x, self.eps)).astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ W^T with W [out, in] in the checkpoint's format; `quantized` selects FP8 blocks."""

    def __init__(self, in_features: int, out_features: int, config: DeepseekV4Config, quantized: bool):
        self.quantized = quantized and config.quantized
        if self.quantized:
            bo, bi = config.quantization.weight_block_size
            scale_dtype = jnp.uint8 if config.quantization.scale_fmt == "ue8m0" else jnp.float32
            self.block = (bo, bi)
            self.weight = nnx.Param(jnp.zeros((out_features, in_features), jnp.float8_e4m3fn))
            self.scale = nnx.Param(
                jnp.zeros((num_blocks(out_features, bo), num_blocks(in_features, bi)), scale_dtype)
            )
        else:
            self.weight = nnx.Param(jnp.zeros((out_features, in_features), STORED_DTYPE))

    def dequantized(self, dtype) -> jax.Array:  # [out, in]
        if self.quantized:
            return wfmt.dequantize_fp8_blocks(self.weight[...], self.scale[...], self.block, dtype)
        return self.weight[...].astype(dtype)

    def __call__(self, x: jax.Array, dtype=None) -> jax.Array:
        dtype = dtype or x.dtype
        return jnp.einsum("...i,oi->...o", x.astype(dtype), self.dequantized(dtype))


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int):
        self.weight = nnx.Param(jnp.zeros((vocab_size, dim), STORED_DTYPE))

    def __call__(self, token_ids: jax.Array, dtype) -> jax.Array:
        return self.weight[...][token_ids].astype(dtype)
