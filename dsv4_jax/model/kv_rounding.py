"""Quantise-dequantise round trips of the official forward (spec 3.8).

These make the full-sequence model round the window and compressed KV exactly as the
fp8_ds_mla cache stores them (NoPE dims to E4M3 with one UE8M0 scale per 64 dims, RoPE dims
to bf16), and the indexer keys as the fp8 indexer cache stores them, so the model can be
compared with a model that reads an fp8 KV cache. Written here, independently of the cache
code, so that each checks the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
KV_QUANT_BLOCK = 64


def ue8m0_exponent(amax: jax.Array) -> jax.Array:
    """ceil(log2(amax / 448)) with amax floored at 1e-4: the scale is 2^exponent, and the UE8M0
    byte that stores it is exponent + 127."""
    ratio = jnp.maximum(amax.astype(jnp.float32), 1e-4) / E4M3_MAX
    # From the float's bits, not log2/exp2 (inexact on XLA:CPU at some powers of two):
    # ratio = m * 2^e with m in [0.5, 1), so ceil(log2(ratio)) is e, or e - 1 when m is 0.5.
    mantissa, exponent = jnp.frexp(ratio)
    return (exponent - (mantissa == 0.5)).astype(jnp.int32)


def _power_of_two(exponent: jax.Array) -> jax.Array:
    return jnp.ldexp(jnp.ones_like(exponent, jnp.float32), exponent)


def fp8_block_quantize(x: jax.Array, block: int = KV_QUANT_BLOCK) -> tuple[jax.Array, jax.Array]:
    """x [..., dim] -> (E4M3 codes [..., dim], scale exponents [..., dim // block] int32)."""
    *lead, dim = x.shape
    if dim % block:
        raise ValueError(f"fp8 round trip needs the last dim ({dim}) to be a multiple of {block}")
    xb = x.astype(jnp.float32).reshape(*lead, dim // block, block)
    exponent = ue8m0_exponent(jnp.max(jnp.abs(xb), axis=-1))
    scale = _power_of_two(exponent)[..., None]
    codes = jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return codes.reshape(x.shape), exponent


def fp8_block_round_trip(x: jax.Array, block: int = KV_QUANT_BLOCK) -> jax.Array:
    """E4M3 round trip with a UE8M0 scale per `block` elements of the last dim."""
    codes, exponent = fp8_block_quantize(x, block)
    *lead, dim = x.shape
    scale = _power_of_two(exponent)[..., None]
    values = codes.astype(jnp.float32).reshape(*lead, dim // block, block) * scale
    return values.reshape(x.shape).astype(x.dtype)


def kv_cache_round_trip(kv: jax.Array, rope_dim: int) -> jax.Array:
    """Round `kv` [..., head_dim] as the fp8_ds_mla cache stores it (spec 8.2)."""
    nope, rope = kv[..., :-rope_dim], kv[..., -rope_dim:]
    nope = fp8_block_round_trip(nope)
    rope = rope.astype(jnp.bfloat16).astype(kv.dtype)
    return jnp.concatenate([nope, rope], axis=-1)


def indexer_key_round_trip(keys: jax.Array) -> jax.Array:
    """Round indexer keys [..., index_head_dim] as the fp8 indexer cache stores them:
    E4M3 with one power-of-two (UE8M0-rounded) fp32 scale per key."""
    return fp8_block_round_trip(keys, block=keys.shape[-1])
