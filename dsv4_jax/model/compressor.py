"""KV compressors (spec 3.6) and the lightning indexer (spec 3.7).

A compressor pools every `ratio` tokens into one entry with a per-channel softmax gate. On
CSA layers the windows overlap: each token projects to 2x the width, the first half feeding
the next window's entry and the second half its own, so entry j pools 2 * ratio rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.model import qat
from dsv4_jax.model.layers import Linear, RMSNorm
from dsv4_jax.model.rope import apply_rope


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
        *,
        overlap: bool | None = None,
        neox: bool = False,
    ) -> jax.Array:  # [batch, seq // ratio, head_dim]
        """Entries of all complete windows, normalised and rotated, in x.dtype."""
        overlap = self.overlap if overlap is None else overlap
        batch, seq, _ = x.shape
        r, d = self.ratio, self.head_dim
        n = seq // r
        if n == 0:
            return jnp.zeros((batch, 0, d), x.dtype)
        x32 = x[:, : n * r].astype(jnp.float32)  # the official compressor runs in fp32
        kv = self.wkv(x32, jnp.float32).reshape(batch, n, r, -1)
        score = self.wgate(x32, jnp.float32).reshape(batch, n, r, -1) + self.ape[...].astype(jnp.float32)
        if self.overlap:
            current_kv, current_score = kv[..., d:], score[..., d:]
            if overlap:
                # Rows of the previous window through the first half; window 0 has none.
                prev_kv = jnp.pad(kv[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
                prev_score = jnp.pad(
                    score[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf
                )
                kv = jnp.concatenate([prev_kv, current_kv], axis=2)
                score = jnp.concatenate([prev_score, current_score], axis=2)
            else:  # ablation: ignore the overlap
                kv, score = current_kv, current_score
        weights = jax.nn.softmax(score, axis=2)  # per channel over the pooled rows
        pooled = jnp.sum(kv * weights, axis=2).astype(x.dtype)  # [batch, n, d]
        pooled = self.norm(pooled)
        entry_cos, entry_sin = cos[: n * r : r], sin[: n * r : r]
        return apply_rope(pooled, entry_cos, entry_sin, neox=neox)


class Indexer(nnx.Module):
    """Scores compressed entries for each query and keeps the top-k (CSA layers only)."""

    def __init__(self, config: DeepseekV4Config, ratio: int):
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.ratio = ratio
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, config, quantized=True)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, config, quantized=False)
        self.compressor = Compressor(config, ratio, self.head_dim, overlap=True)

    def __call__(
        self,
        x: jax.Array,  # [batch, seq, hidden] attention input
        q_latent: jax.Array,  # [batch, seq, q_lora_rank] q_norm(wq_a x)
        cos: jax.Array,
        sin: jax.Array,
        *,
        round_keys: bool = False,
        overlap: bool = True,
        neox: bool = False,
    ) -> jax.Array:  # [batch, seq, min(topk, entries)] int32, -1 = nothing to read
        batch, seq, _ = x.shape
        keys = self.compressor(x, cos, sin, overlap=overlap, neox=neox)  # [batch, n, index_head_dim]
        if round_keys:
            keys = qat.indexer_key_round_trip(keys)
        q = self.wq_b(q_latent).reshape(batch, seq, self.n_heads, self.head_dim)
        q = apply_rope(q, cos, sin, heads_axis=True, neox=neox)
        scores = jnp.einsum("bshd,bnd->bshn", q.astype(jnp.float32), keys.astype(jnp.float32))
        head_weights = self.weights_proj(x, jnp.float32) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        scores = jnp.einsum("bshn,bsh->bsn", jax.nn.relu(scores), head_weights)
        return select_visible_topk(scores, self.ratio, self.topk)


def select_visible_topk(
    scores: jax.Array,  # [batch, seq, entries] indexer scores of query t (position t) for entry j
    ratio: int,
    topk: int,
) -> jax.Array:  # [batch, seq, min(topk, entries)] int32
    """The top-k visible entries (j < (t + 1) // ratio) per query; picks that are not visible
    (fewer than k visible) become -1. Equal scores go to the lowest index, so what position t
    selects never depends on how many later entries exist (torch.topk does not promise this)."""
    seq, n = scores.shape[-2:]
    visible = jnp.arange(n)[None, :] < (jnp.arange(seq)[:, None] + 1) // ratio  # [seq, n]
    scores = jnp.where(visible, scores, -jnp.inf)
    _, idx = jax.lax.top_k(scores, min(topk, n))  # lax.top_k returns equal values lowest index first
    picked_visible = jnp.take_along_axis(jnp.broadcast_to(visible, scores.shape), idx, axis=-1)
    return jnp.where(picked_visible, idx, -1).astype(jnp.int32)
