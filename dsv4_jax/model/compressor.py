"""KV compressors (spec 3.6).

A compressor pools every `ratio` tokens into one entry with a per-channel softmax gate. On
CSA layers the windows overlap: each token projects to 2x the width, the first half feeding
the next window's entry and the second half its own, so entry j pools 2 * ratio rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.model.layers import Linear, RMSNorm
from dsv4_jax.model.rope import apply_rope


def overlapping_windows(
    kv: jax.Array,  # [batch, n, ratio, 2 * head_dim] each token's 2x-wide projection
    score: jax.Array,  # [batch, n, ratio, 2 * head_dim] gate logits (ape added)
    head_dim: int,
) -> tuple[jax.Array, jax.Array]:  # each [batch, n, 2 * ratio, head_dim]
    """The rows CSA entry j pools: window j - 1 through the first half of the projection, then
    window j through the second half. Window 0 has no predecessor: zero rows with -inf scores,
    so the softmax gives them no weight."""
    pad = ((0, 0), (1, 0), (0, 0), (0, 0))
    prev_kv = jnp.pad(kv[:, :-1, :, :head_dim], pad)
    prev_score = jnp.pad(score[:, :-1, :, :head_dim], pad, constant_values=-jnp.inf)
    kv = jnp.concatenate([prev_kv, kv[..., head_dim:]], axis=2)
    score = jnp.concatenate([prev_score, score[..., head_dim:]], axis=2)
    return kv, score


class Compressor(nnx.Module):
    def __init__(self, config: DeepseekV4Config, ratio: int, head_dim: int, overlap: bool):
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = Linear(config.hidden_size, width, config, quantized=False)
        self.wgate = Linear(config.hidden_size, width, config, quantized=False)
        self.ape = nnx.Param(jnp.zeros((ratio, width), jnp.float32))
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)

    def __call__(
        self,
        x: jax.Array,  # [batch, seq, hidden]
        cos: jax.Array,  # [seq, rope/2] angles of token positions (entry j uses position j * ratio)
        sin: jax.Array,
    ) -> jax.Array:  # [batch, seq // ratio, head_dim]
        """Entries of all complete windows, normalised and rotated, in x.dtype."""
        batch, seq, _ = x.shape
        r, d = self.ratio, self.head_dim
        n = seq // r
        if n == 0:
            return jnp.zeros((batch, 0, d), x.dtype)
        x32 = x[:, : n * r].astype(jnp.float32)  # the official compressor runs in fp32
        kv = self.wkv(x32, jnp.float32).reshape(batch, n, r, -1)
        score = self.wgate(x32, jnp.float32).reshape(batch, n, r, -1) + self.ape[...].astype(jnp.float32)
        if self.overlap:
            kv, score = overlapping_windows(kv, score, d)
        weights = jax.nn.softmax(score, axis=2)  # per channel over the pooled rows
        pooled = jnp.sum(kv * weights, axis=2).astype(x.dtype)  # [batch, n, d]
        pooled = self.norm(pooled)
        entry_cos, entry_sin = cos[: n * r : r], sin[: n * r : r]
        return apply_rope(pooled, entry_cos, entry_sin)
