"""A decoder block (spec 4.3): hc_pre -> attention -> hc_post, hc_pre -> MoE -> hc_post."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.model.attention import Attention
from dsv4_jax.kv_cache.paged import PagedKVCache
from dsv4_jax.model.cache_step import CacheStep, LayerPlace, StepSequences
from dsv4_jax.model.hyper_connection import hc_post, hc_pre
from dsv4_jax.model.layers import RMSNorm
from dsv4_jax.model.moe import MoE
from dsv4_jax.model.options import ForwardOptions
from dsv4_jax.model.axes import HC


class Block(nnx.Module):
    def __init__(self, config: DeepseekV4Config, layer_type: str, ratio: int, hash_routed: bool):
        c = config
        self.config = c
        n = c.hc_mult
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c, layer_type, ratio)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn = MoE(c, hash_routed)
        mix = (2 + n) * n
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nnx.Param(jnp.zeros((mix, n * c.hidden_size), jnp.float32), axes=(HC, HC)))
            setattr(self, f"hc_{site}_base", nnx.Param(jnp.zeros((mix,), jnp.float32), axes=(HC,)))
            setattr(self, f"hc_{site}_scale", nnx.Param(jnp.zeros((3,), jnp.float32), axes=(HC,)))

    def _hc_pre(self, streams: jax.Array, site: str):
        c = self.config
        return hc_pre(
            streams,
            getattr(self, f"hc_{site}_fn")[...],
            getattr(self, f"hc_{site}_base")[...],
            getattr(self, f"hc_{site}_scale")[...],
            norm_eps=c.rms_norm_eps,
            hc_eps=c.hc_eps,
            sinkhorn_iters=c.hc_sinkhorn_iters,
        )

    def __call__(
        self,
        streams: jax.Array,  # [batch, seq, hc_mult, hidden]
        token_ids: jax.Array,  # [batch, seq]
        cos: jax.Array,  # [seq, rope/2]
        sin: jax.Array,
        options: ForwardOptions,
    ) -> jax.Array:  # [batch, seq, hc_mult, hidden]
        """The block over a whole sequence (the reference forward; `step` is the serving path)."""
        x, post, comb = self._hc_pre(streams, "attn")
        out = self.attn(self.attn_norm(x), cos, sin, options)
        return self._ffn(hc_post(out, streams, post, comb), token_ids, options)

    def step(
        self,
        streams: jax.Array,  # [batch, S, hc_mult, hidden]
        token_ids: jax.Array,  # [batch, S]
        rotation: tuple[jax.Array, jax.Array, jax.Array],  # cos, sin [batch, S, rope/2], inv_freq
        cache: PagedKVCache,
        ctx: CacheStep,
        seqs: StepSequences,
        place: LayerPlace,
        options: ForwardOptions,
    ) -> tuple[jax.Array, PagedKVCache]:
        """The block on the paged cache (`Attention.step`); the MoE half is the same as above."""
        x, post, comb = self._hc_pre(streams, "attn")
        out, cache = self.attn.step(self.attn_norm(x), rotation, cache, ctx, seqs, place)
        valid = jnp.arange(token_ids.shape[1])[None, :] < seqs.lens[:, None]  # padding runs no expert
        return self._ffn(hc_post(out, streams, post, comb), token_ids, options, valid), cache

    def _ffn(self, streams: jax.Array, token_ids: jax.Array, options: ForwardOptions,
             valid: jax.Array | None = None) -> jax.Array:
        x, post, comb = self._hc_pre(streams, "ffn")
        return hc_post(self.ffn(self.ffn_norm(x), token_ids, options, valid), streams, post, comb)
