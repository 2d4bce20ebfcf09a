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


def ue8m0_scale(amax: jax.Array) -> jax.Array:
    """Power-of-two scale 2^ceil(log2(amax / 448)) with amax floored at 1e-4."""
    amax = jnp.maximum(amax.astype(jnp.float32), 1e-4)
    return jnp.exp2(jnp.ceil(jnp.log2(amax / E4M3_MAX)))


def fp8_block_round_trip(x: jax.Array, block: int = KV_QUANT_BLOCK) -> jax.Array:
    """E4M3 round trip with a UE8M0 scale per `block` elements of the last dim."""
    *lead, dim = x.shape
    if dim % block:
        raise ValueError(f"fp8 round trip needs the last dim ({dim}) to be a multiple of {block}")
    xb = x.astype(jnp.float32).reshape(*lead, dim // block, block)
    scale = ue8m0_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True))
    q = jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return (q.astype(jnp.float32) * scale).reshape(x.shape).astype(x.dtype)


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
