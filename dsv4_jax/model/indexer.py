"""The lightning indexer (spec 3.7): on CSA layers, scores every compressed entry for each query
and keeps the top-k visible ones for the attention to read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.model import kv_rounding
from dsv4_jax.model.compressor import Compressor
from dsv4_jax.model.layers import Linear
from dsv4_jax.model.rope import apply_rope
from dsv4_jax.model.axes import EMBED, INDEXER, Q_LORA


class Indexer(nnx.Module):
    """Scores compressed entries for each query and keeps the top-k (CSA layers only)."""

    def __init__(self, config: DeepseekV4Config, ratio: int):
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.ratio = ratio
        # Replicated: its head-summed scores pick entries by top-k, and a sharded sum's
        # reduction order could flip near-ties.
        self.wq_b = Linear(
            config.q_lora_rank, self.n_heads * self.head_dim, config, quantized=True, axes=(INDEXER, Q_LORA)
        )
        self.weights_proj = Linear(config.hidden_size, self.n_heads, config, quantized=False, axes=(INDEXER, EMBED))
        self.compressor = Compressor(config, ratio, self.head_dim, overlap=True)

    def queries(self, q_latent: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """q_latent [batch, seq, q_lora_rank] (the main attention's q_norm output) -> rotated
        indexer queries [batch, seq, heads, head_dim]."""
        batch, seq, _ = q_latent.shape
        q = self.wq_b(q_latent).reshape(batch, seq, self.n_heads, self.head_dim)
        return apply_rope(q, cos, sin, heads_axis=True)

    def head_weights(self, x: jax.Array) -> jax.Array:
        """Per-head score weights [batch, seq, heads] fp32, softmax scale and 1/sqrt(heads) folded in."""
        return self.weights_proj.float32(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)

    def __call__(
        self,
        x: jax.Array,  # [batch, seq, hidden] attention input
        q_latent: jax.Array,  # [batch, seq, q_lora_rank] q_norm(wq_a x)
        cos: jax.Array,  # [seq, rope/2]
        sin: jax.Array,
        *,
        round_keys: bool = False,
    ) -> jax.Array:  # [batch, seq, k] int32, -1 = nothing to read (k = min(topk, entries) here)
        """Top-k entries per query of a whole sequence (the reference selection; cached steps pick
        with the backend's `indexer_topk` over the cached keys instead)."""
        return select_visible_topk(self.scores(x, q_latent, cos, sin, round_keys=round_keys), self.ratio, self.topk)

    def scores(
        self,
        x: jax.Array,  # [batch, seq, hidden] attention input
        q_latent: jax.Array,  # [batch, seq, q_lora_rank]
        cos: jax.Array,  # [seq, rope/2]
        sin: jax.Array,
        *,
        round_keys: bool = False,
    ) -> jax.Array:  # [batch, seq, n] float32: query t's score of compressed entry j, visible or not
        """The dense selection's scores (sum over heads of weight x relu(q . key)); public so that
        `dsv4_jax.testing.indexer_topk_margins` can measure how close its top-k is to a tie."""
        keys = self.compressor(x, cos, sin)  # [batch, n, index_head_dim]
        q, weights = self.queries(q_latent, cos, sin), self.head_weights(x)
        if round_keys:
            keys = kv_rounding.indexer_key_round_trip(keys)
        scores = jnp.einsum("bshd,bnd->bshn", q.astype(jnp.float32), keys.astype(jnp.float32))
        return jnp.einsum("bshn,bsh->bsn", jax.nn.relu(scores), weights)


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
