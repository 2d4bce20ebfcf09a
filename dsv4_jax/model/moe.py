"""Mixture of experts (spec 5): sqrt-softplus router with a selection-only bias or hash
routing, top-k renormalised weights x routed_scaling_factor, clamped SwiGLU experts and a
shared expert.

Routed experts run as a grouped matmul over (token, expert) pairs sorted by expert: each
expert's rows are padded to a tile of `G` rows and each tile multiplies one expert's weights,
dequantised from the checkpoint format per tile. `G` is at most pairs / experts, so the padding
(under one tile per expert) stays below the useful rows: FLOPs are at most about twice
tokens x top-k x the expert matmuls whatever the expert count (exactly that when `G` = 1).
Weight fetches (one per tile) number at most about 2 x the experts in use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4_jax import weights as wfmt
from dsv4_jax.config import DeepseekV4Config, num_blocks
from dsv4_jax.model.layers import STORED_DTYPE, Linear
from dsv4_jax.sharding import EMBED, EXPERTS, HASH_VOCAB, MOE_FFN, ROUTER, SHARED_FFN

# Tiles at most this many at a time through the experts (bounds the gathered-weight memory).
_TILES_PER_STEP = 64


class ExpertWeights(nnx.Module):
    """One projection of all routed experts, stacked: weight [experts, out, in] as stored.
    `axes`: logical names of [experts, out, in], shared by the scales."""

    def __init__(
        self, n_experts: int, in_features: int, out_features: int, config: DeepseekV4Config, axes: tuple[str, str, str]
    ):
        self.format = config.expert_dtype if config.quantized else None
        if self.format == "fp4":
            self.weight = nnx.Param(jnp.zeros((n_experts, out_features, in_features // 2), jnp.uint8), axes=axes)
            self.scale = nnx.Param(jnp.zeros((n_experts, out_features, in_features // 32), jnp.uint8), axes=axes)
        elif self.format == "fp8":
            bo, bi = config.quantization.weight_block_size
            self.block = (bo, bi)
            scale_dtype = jnp.uint8 if config.quantization.scale_fmt == "ue8m0" else jnp.float32
            self.weight = nnx.Param(jnp.zeros((n_experts, out_features, in_features), jnp.float8_e4m3fn), axes=axes)
            self.scale = nnx.Param(
                jnp.zeros((n_experts, num_blocks(out_features, bo), num_blocks(in_features, bi)), scale_dtype),
                axes=axes,
            )
        else:
            self.weight = nnx.Param(jnp.zeros((n_experts, out_features, in_features), STORED_DTYPE), axes=axes)

    def gather(self, experts: jax.Array, dtype) -> jax.Array:
        """Dequantised weights of the given experts. experts [n] -> [n, out, in]"""
        w = self.weight[...][experts]
        if self.format == "fp4":
            return jax.vmap(lambda p, s: wfmt.dequantize_mxfp4(p, s, dtype))(w, self.scale[...][experts])
        if self.format == "fp8":
            return jax.vmap(lambda q, s: wfmt.dequantize_fp8_blocks(q, s, self.block, dtype))(
                w, self.scale[...][experts]
            )
        return w.astype(dtype)


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, L)) * clamp(up, -L, L); L = 0 means no clamp."""
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


class SharedExpert(nnx.Module):
    def __init__(self, config: DeepseekV4Config):
        width = config.n_shared_experts * config.moe_intermediate_size
        self.w1 = Linear(config.hidden_size, width, config, quantized=True, axes=(SHARED_FFN, EMBED))
        self.w2 = Linear(width, config.hidden_size, config, quantized=True, axes=(EMBED, SHARED_FFN))
        self.w3 = Linear(config.hidden_size, width, config, quantized=True, axes=(SHARED_FFN, EMBED))
        self.limit = config.swiglu_limit

    def __call__(self, x: jax.Array) -> jax.Array:
        h = swiglu(self.w1(x).astype(jnp.float32), self.w3(x).astype(jnp.float32), self.limit)
        return self.w2(h.astype(x.dtype))


class Gate(nnx.Module):
    def __init__(self, config: DeepseekV4Config, hash_routed: bool):
        self.hash_routed = hash_routed
        self.top_k, self.scoring = config.num_experts_per_tok, config.scoring_func
        self.renormalize = config.norm_topk_prob or config.scoring_func != "softmax"
        self.scaling = config.routed_scaling_factor
        self.weight = nnx.Param(
            jnp.zeros((config.n_routed_experts, config.hidden_size), STORED_DTYPE), axes=(ROUTER, EMBED)
        )
        if hash_routed:
            self.tid2eid = nnx.Param(
                jnp.zeros((config.vocab_size, config.num_experts_per_tok), jnp.int32), axes=(HASH_VOCAB, ROUTER)
            )
        elif config.topk_method == "noaux_tc":
            self.bias = nnx.Param(jnp.zeros((config.n_routed_experts,), jnp.float32), axes=(ROUTER,))

    def __call__(self, x: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [tokens, hidden], token_ids [tokens] -> (experts [tokens, k] int32, weights [tokens, k] f32)"""
        logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        if self.scoring == "sqrtsoftplus":
            scores = jnp.sqrt(jax.nn.softplus(logits))
        elif self.scoring == "sigmoid":
            scores = jax.nn.sigmoid(logits)
        else:
            scores = jax.nn.softmax(logits, axis=-1)
        if self.hash_routed:
            experts = self.tid2eid[...][token_ids].astype(jnp.int32)
            weights = jnp.take_along_axis(scores, experts, axis=-1)
        else:
            bias = self.bias[...] if hasattr(self, "bias") else jnp.zeros((scores.shape[-1],), jnp.float32)
            experts, weights = select_experts(scores, bias, self.top_k)
        if self.renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return experts, weights * self.scaling


def select_experts(
    scores: jax.Array,  # [tokens, experts] float32 router scores
    bias: jax.Array,  # [experts] float32 selection bias (noaux_tc; zeros without one)
    top_k: int,
) -> tuple[jax.Array, jax.Array]:  # (experts [tokens, k] int32, weights [tokens, k] float32)
    """Top-k experts by score + bias; their weights are the unbiased scores (spec 5: the bias
    balances the load by steering selection, it never weighs an expert's output)."""
    _, experts = jax.lax.top_k(scores + bias, top_k)
    return experts, jnp.take_along_axis(scores, experts, axis=-1)


class MoE(nnx.Module):
    def __init__(self, config: DeepseekV4Config, hash_routed: bool):
        c = config
        self.limit = c.swiglu_limit
        self.gate = Gate(c, hash_routed)
        self.experts = RoutedExperts(c)
        if c.n_shared_experts:
            self.shared_experts = SharedExpert(c)

    def __call__(self, x: jax.Array, token_ids: jax.Array) -> jax.Array:
        """x [batch, seq, hidden] ffn_norm output, token_ids [batch, seq] -> [batch, seq, hidden]"""
        batch, seq, hidden = x.shape
        flat = x.reshape(-1, hidden)
        experts, weights = self.gate(flat, token_ids.reshape(-1))
        out = self.experts(flat, experts, weights, self.limit)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat).astype(jnp.float32)
        return out.astype(x.dtype).reshape(batch, seq, hidden)


class RoutedExperts(nnx.Module):
    def __init__(self, config: DeepseekV4Config):
        e, d, f = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.w1 = ExpertWeights(e, d, f, config, axes=(EXPERTS, MOE_FFN, EMBED))
        self.w2 = ExpertWeights(e, f, d, config, axes=(EXPERTS, EMBED, MOE_FFN))
        self.w3 = ExpertWeights(e, d, f, config, axes=(EXPERTS, MOE_FFN, EMBED))
        self.n_experts = e

    def __call__(
        self,
        x: jax.Array,  # [tokens, hidden]
        experts: jax.Array,  # [tokens, k] int32
        weights: jax.Array,  # [tokens, k] float32
        limit: float,
    ) -> jax.Array:  # [tokens, hidden] float32
        tokens, k = experts.shape
        pairs = tokens * k
        tile, n_tiles = tile_plan(pairs, self.n_experts)
        rows = n_tiles * tile

        pair_expert = experts.reshape(-1)
        order = jnp.argsort(pair_expert, stable=True)
        sorted_expert = pair_expert[order]
        sorted_token = order // k
        sorted_weight = weights.reshape(-1)[order]
        if tile == 1:
            dest, tile_expert = jnp.arange(pairs), sorted_expert
        else:
            counts = jnp.bincount(pair_expert, length=self.n_experts)
            padded = (counts + tile - 1) // tile * tile
            start = jnp.cumsum(counts) - counts
            padded_start = jnp.cumsum(padded) - padded
            dest = padded_start[sorted_expert] + jnp.arange(pairs) - start[sorted_expert]
            # Expert of each tile: the last expert whose padded group starts at or before it.
            tile_start = jnp.arange(n_tiles) * tile
            tile_expert = jnp.searchsorted(padded_start + padded, tile_start, side="right")
            tile_expert = jnp.minimum(tile_expert, self.n_experts - 1).astype(jnp.int32)
        row_token = jnp.zeros((rows,), jnp.int32).at[dest].set(sorted_token.astype(jnp.int32))
        row_weight = jnp.zeros((rows,), jnp.float32).at[dest].set(sorted_weight)  # padding rows weigh 0
        is_pair = jnp.zeros((rows,), bool).at[dest].set(True)
        x_rows = jnp.where(is_pair[:, None], x[row_token], 0).reshape(n_tiles, tile, -1)  # padding rows: zeros
        w_rows = row_weight.reshape(n_tiles, tile)
        dtype = x.dtype

        def run_tiles(args):
            xt, wt, et = args  # [n, tile, hidden], [n, tile], [n]
            g = jnp.einsum("ntd,nfd->ntf", xt, self.w1.gather(et, dtype))
            u = jnp.einsum("ntd,nfd->ntf", xt, self.w3.gather(et, dtype))
            h = (swiglu(g.astype(jnp.float32), u.astype(jnp.float32), limit) * wt[..., None]).astype(dtype)
            return jnp.einsum("ntf,ndf->ntd", h, self.w2.gather(et, dtype)).astype(jnp.float32)

        if n_tiles <= _TILES_PER_STEP:
            y = run_tiles((x_rows, w_rows, tile_expert))
        else:
            y = jax.lax.map(
                lambda a: run_tiles(jax.tree.map(lambda v: v[None], a))[0],
                (x_rows, w_rows, tile_expert),
                batch_size=_TILES_PER_STEP,
            )
        return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[row_token].add(y.reshape(rows, -1))


def tile_plan(pairs: int, n_experts: int) -> tuple[int, int]:
    """(rows per tile G, number of tiles) for `pairs` (token, expert) pairs.

    G is the largest power of two <= pairs / experts. Decode-sized batches (pairs < 2 x experts)
    get G = 1: one tile per pair, no padding. Otherwise each expert's rows are padded to whole
    tiles, which adds less than one tile per expert, E x G <= pairs rows: the matmul rows stay
    within 2 x pairs, and doubling the experts halves G instead of adding rows."""
    per_expert = max(pairs // n_experts, 1)
    tile = 1 << (per_expert.bit_length() - 1)
    if tile == 1:
        return 1, pairs
    return tile, math.ceil(pairs / tile) + min(n_experts, pairs)
