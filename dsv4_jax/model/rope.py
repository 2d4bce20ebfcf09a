"""Interleaved partial RoPE on the trailing `qk_rope_head_dim` dims (spec 3.3)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.config import DeepseekV4Config, YarnScaling


def inverse_frequencies(rope_dim: int, base: float, yarn: YarnScaling | None) -> np.ndarray:
    """f_i = base^(-2i/dim), with DeepSeek's YaRN blend when `yarn` is enabled. [rope_dim // 2]"""
    freqs = 1.0 / (base ** (np.arange(0, rope_dim, 2, dtype=np.float32) / rope_dim))
    if yarn is None or not yarn.enabled:
        return freqs.astype(np.float32)

    def correction_dim(num_rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(base)
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / (high - low), 0.0, 1.0)
    smooth = 1.0 - ramp
    return (freqs / yarn.factor * (1.0 - smooth) + freqs * smooth).astype(np.float32)


def layer_frequencies(config: DeepseekV4Config, layer: int) -> np.ndarray:
    """Sliding layers (and MTP) use `rope_theta` without YaRN; compressed layers use
    `compress_rope_theta` with YaRN. One table per layer for q, KV, compressor and indexer."""
    if config.compress_ratio(layer) == 0:
        return inverse_frequencies(config.qk_rope_head_dim, config.rope_theta, None)
    return inverse_frequencies(config.qk_rope_head_dim, config.compress_rope_theta, config.rope_scaling)


def rope_angles(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of positions x frequencies. positions [...] -> [..., rope_dim // 2] float32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: jax.Array,  # [..., seq, (heads,) dim]
    cos: jax.Array,  # [..., seq, rope_dim // 2]
    sin: jax.Array,
    *,
    inverse: bool = False,
    heads_axis: bool = False,
) -> jax.Array:
    """Rotate the trailing rope slice of `x` as pairs (x[2i], x[2i+1]) (GPT-J style, not
    NeoX's rotate-half); `inverse` rotates by the conjugate."""
    half = cos.shape[-1]
    rope_dim = 2 * half
    if heads_axis:
        cos, sin = cos[..., None, :], sin[..., None, :]
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].astype(jnp.float32)
    pairs = rope.reshape(*rope.shape[:-1], half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)
