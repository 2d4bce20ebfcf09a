"""V4 attention (spec 3): MQA with one shared K=V head, partial interleaved RoPE, sinks,
a sliding window, and on compressed layers a compressor (+ lightning indexer on CSA)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax.config import CSA, SLIDING, DeepseekV4Config
from dsv4_jax.model import kv_rounding
from dsv4_jax.model.attention_core import AttentionCore, dense_attention
from dsv4_jax.model.compressor import Compressor
from dsv4_jax.model.indexer import Indexer
from dsv4_jax.model.layers import Linear, RMSNorm, rms_normalize
from dsv4_jax.model.options import ForwardOptions
from dsv4_jax.model.rope import apply_rope


class Attention(nnx.Module):
    def __init__(self, config: DeepseekV4Config, layer_type: str, ratio: int):
        c = config
        self.layer_type, self.ratio = layer_type, ratio
        self.n_heads, self.head_dim, self.rope_dim = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim
        self.window, self.eps = c.sliding_window, c.rms_norm_eps
        self.o_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, c, quantized=True)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, c, quantized=True)
        self.wkv = Linear(c.hidden_size, c.head_dim, c, quantized=True)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        group_in = c.num_attention_heads * c.head_dim // c.o_groups
        self.wo_a = Linear(group_in, c.o_groups * c.o_lora_rank, c, quantized=True)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, c, quantized=True)
        self.attn_sink = nnx.Param(jnp.zeros((c.num_attention_heads,), jnp.float32))
        if layer_type != SLIDING:
            self.compressor = Compressor(c, ratio, c.head_dim, overlap=layer_type == CSA)
        if layer_type == CSA:
            self.indexer = Indexer(c, ratio)

    def __call__(
        self,
        x: jax.Array,  # [batch, seq, hidden] attn_norm output
        cos: jax.Array,  # [seq, rope/2] this layer's table at positions 0..seq-1
        sin: jax.Array,
        options: ForwardOptions,
        core: AttentionCore = dense_attention,
    ) -> jax.Array:  # [batch, seq, hidden]
        batch, seq, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).reshape(batch, seq, self.n_heads, self.head_dim)
        q = rms_normalize(q, self.eps).astype(x.dtype)  # weightless per-head RMSNorm
        q = apply_rope(q, cos, sin, heads_axis=True)
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)  # [batch, seq, head_dim], K = V
        if options.kv_cache_rounding:
            kv = kv_rounding.kv_cache_round_trip(kv, self.rope_dim)

        compressed = compressed_idx = None
        if self.layer_type != SLIDING:
            compressed = self.compressor(x, cos, sin)
            if options.kv_cache_rounding:
                compressed = kv_rounding.kv_cache_round_trip(compressed, self.rope_dim)
        if self.layer_type == CSA:
            compressed_idx = self.indexer(x, q_latent, cos, sin, round_keys=options.kv_cache_rounding)
        sinks = self.attn_sink[...].astype(jnp.float32)
        out = core(q, kv, compressed, compressed_idx, sinks, window=self.window, ratio=max(self.ratio, 1))
        # K = V carries RoPE, so the output does too: rotate it back by the query's position.
        out = apply_rope(out.astype(x.dtype), cos, sin, inverse=True, heads_axis=True)
        # Grouped output projection: group g holds heads [g*H/G, (g+1)*H/G).
        grouped = out.reshape(batch, seq, self.o_groups, -1)
        wo_a = self.wo_a.dequantized(x.dtype).reshape(self.o_groups, self.o_lora_rank, -1)
        z = jnp.einsum("bsgi,gri->bsgr", grouped, wo_a).reshape(batch, seq, -1)
        return self.wo_b(z)
