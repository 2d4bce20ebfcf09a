"""Building blocks: RMSNorm and linears that keep the checkpoint's storage format.

A linear holds `weight` exactly as the checkpoint stores it ([out, in]: bf16/f32, or FP8 E4M3
with a `scale` block grid of UE8M0 bytes or f32) and dequantises inside the jitted forward,
per use, so no dequantised copy of a weight ever lives on the device.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax.model import weight_formats as wfmt
from dsv4_jax.config import DeepseekV4Config, num_blocks
from dsv4_jax.model.axes import EMBED, NORM, VOCAB

# Placeholder dtype of tensors DeepSeek stores in bf16 (the abstract model's shapes and dtypes);
# loading takes whatever dtype the checkpoint file has (transformers saves float32).
STORED_DTYPE = jnp.bfloat16

# Float32 rows up to which `Linear.float32` multiplies three bf16 slices of x by a bf16 weight as
# stored rather than converting the whole weight for the call (the slices triple the rows). GPUs:
# 32. XLA:CPU runs a bf16 weight fast (YNNPACK) up to 64 matmul rows and leaves that path above
# (129280 x 128 head: 64 rows 4.1 ms, 65 rows 15.9 ms), so 21 there.
SLICED_MAX_ROWS = 32
CPU_SLICED_MAX_ROWS = 21

# Metadata key of an `nnx.Param` stored as the transpose of its checkpoint tensor (`Linear(transposed=True)`).
TRANSPOSED = "checkpoint_transposed"


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
    `axes` are the logical axis names (`dsv4_jax.parallel.sharding`) of [out, in]; the block scales
    carry the same names, so they split along the same mesh axes as the weight (None: undeclared,
    which `sharding.partition_spec` refuses; only standalone test linears leave it out)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        config: DeepseekV4Config,
        quantized: bool,
        axes: tuple[str, str] | None = None,
        transposed: bool = False,
    ):
        self.quantized = quantized and config.quantized
        # transposed: the weight lives as W^T [in, out], the checkpoint's tensor transposed once
        # at load (`TRANSPOSED` metadata tells the loader). For a short, wide weight such as the
        # vocabulary head, XLA:CPU's dot streams an [in, out] weight faster than an [out, in] one
        # (129280 x 128 head: 32 rows ~20% faster on an Intel Xeon; on an AMD EPYC 2 rows ~20%, 32
        # rows within noise).
        self.transposed = transposed and not self.quantized
        if self.quantized:
            bo, bi = config.quantization.weight_block_size
            scale_dtype = jnp.uint8 if config.quantization.scale_fmt == "ue8m0" else jnp.float32
            self.block = (bo, bi)
            self.weight = nnx.Param(jnp.zeros((out_features, in_features), jnp.float8_e4m3fn), axes=axes)
            self.scale = nnx.Param(
                jnp.zeros((num_blocks(out_features, bo), num_blocks(in_features, bi)), scale_dtype), axes=axes
            )
        elif self.transposed:
            self.weight = nnx.Param(jnp.zeros((in_features, out_features), STORED_DTYPE),
                                    axes=None if axes is None else axes[::-1], **{TRANSPOSED: True})
        else:
            self.weight = nnx.Param(jnp.zeros((out_features, in_features), STORED_DTYPE), axes=axes)

    def dequantized(self, dtype) -> jax.Array:  # [out, in], or [in, out] when transposed
        if self.quantized:
            return wfmt.dequantize_fp8_blocks(self.weight[...], self.scale[...], self.block, dtype)
        return self.weight[...].astype(dtype)

    def __call__(self, x: jax.Array, dtype=None) -> jax.Array:
        dtype = dtype or x.dtype
        return jnp.einsum("...i,io->...o" if self.transposed else "...i,oi->...o", x.astype(dtype),
                          self.dequantized(dtype))

    def float32(self, x: jax.Array) -> jax.Array:
        """x [..., in] -> x @ W^T [..., out] in float32, for the linears the spec computes in fp32
        (vocabulary head, compressors, indexer head weights). A bf16 weight is read as stored
        (`float32_matmul_bf16`) rather than converted on every call (for a 1024 x 1024 compressor
        weight the conversion alone took ~5 ms of a CPU decode step), except for float32 x with
        more rows than its three bf16 slices pay for."""
        weight = self.weight[...]
        if self.quantized or weight.dtype != jnp.bfloat16:
            return self(x, jnp.float32)
        on_cpu = jax.default_backend() == "cpu"
        if x.dtype != jnp.bfloat16 and math.prod(x.shape[:-1]) > (CPU_SLICED_MAX_ROWS if on_cpu else SLICED_MAX_ROWS):
            return self(x, jnp.float32)
        return float32_matmul_bf16(x, weight, min_rows=2 if on_cpu else 1, transposed=self.transposed)


def float32_matmul_bf16(
    x: jax.Array,  # [..., in] bfloat16 or float32
    weight: jax.Array,  # [out, in] bfloat16 ([in, out] when transposed)
    min_rows: int = 1,
    transposed: bool = False,
) -> jax.Array:  # [..., out] float32: x @ W^T as a float32 matmul computes it
    """The float32 product with a bf16 weight, without converting the weight.

    Converting first materialises a float32 copy of the whole weight on every call (XLA:CPU does
    not fuse the convert into the dot): for the 129280 x 128 vocabulary head that copy was most
    of a decode step. bf16 x bf16 products are exact in float32, so one bf16 dot with float32
    accumulation gives the float32 product up to summation order: directly for bf16 x (the final
    norm's output in bf16 models), and for float32 x over three bf16 slices of it (hi + mid + lo
    = x to float32 precision) in the same dot. Fewer matmul rows than `min_rows` are padded with
    zero rows: XLA:CPU runs a one-row bf16 dot by converting the whole weight first (129280 x 128
    head: 1 row 24 ms, 2 rows 1.9 ms; 32 rows 2.5 ms against 10 ms in float32)."""
    lead, dim = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    if x.dtype == jnp.bfloat16:
        pieces = x.reshape(1, rows, dim)
    else:
        slices, rest = [], x.reshape(rows, dim).astype(jnp.float32)
        for _ in range(3):
            piece = rest.astype(jnp.bfloat16)
            slices.append(piece)
            rest = rest - piece.astype(jnp.float32)
        pieces = jnp.stack(slices)  # [3, rows, in]
    padded = max(rows, -(-min_rows // pieces.shape[0]))
    pieces = jnp.pad(pieces, ((0, 0), (0, padded - rows), (0, 0)))
    y = jax.lax.dot_general(pieces, weight, (((2,), (0 if transposed else 1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return functools.reduce(jnp.add, list(y))[:rows].reshape(*lead, -1)  # hi + mid + lo


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int):
        self.weight = nnx.Param(jnp.zeros((vocab_size, dim), STORED_DTYPE), axes=(VOCAB, EMBED))

    def __call__(self, token_ids: jax.Array, dtype) -> jax.Array:
        return self.weight[...][token_ids].astype(dtype)
