"""V4 attention (spec 3): MQA with one shared K=V head, partial interleaved RoPE, sinks,
a sliding window, and on compressed layers a compressor (+ lightning indexer on CSA)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsv4_jax.config import CSA, SLIDING, DeepseekV4Config
from dsv4_jax.model import kv_rounding
from dsv4_jax.kv_cache.paged import PagedKVCache
from dsv4_jax.kv_cache.resolver import FP8_DS_MLA
from dsv4_jax.model.attention_core import dense_attention
from dsv4_jax.model.cache_step import (
    CacheStep,
    LayerPlace,
    StepSequences,
    entry_slots,
    kept_rows,
    store_rows,
    store_token_row,
    timeline_rows,
    window_slots,
)
from dsv4_jax.model.compressor import Compressor, pool_current_window
from dsv4_jax.model.indexer import Indexer
from dsv4_jax.model.layers import Linear, RMSNorm, rms_normalize
from dsv4_jax.model.options import ForwardOptions
from dsv4_jax.model.rope import apply_rope
from dsv4_jax.model.axes import EMBED, GROUP_HEAD_DIMS, HEAD_DIMS, HEADS, KV_DIM, O_GROUP_RANKS, Q_LORA, TENSOR


class Attention(nnx.Module):
    def __init__(self, config: DeepseekV4Config, layer_type: str, ratio: int):
        c = config
        self.layer_type, self.ratio = layer_type, ratio
        self.n_heads, self.head_dim, self.rope_dim = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim
        self.window, self.eps = c.sliding_window, c.rms_norm_eps
        self.o_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, c, quantized=True, axes=(Q_LORA, EMBED))
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        # Heads split over the tensor axis: wq_b's rows are heads x head_dim, head-major.
        self.wq_b = Linear(
            c.q_lora_rank, c.num_attention_heads * c.head_dim, c, quantized=True, axes=(HEAD_DIMS, Q_LORA)
        )
        self.wkv = Linear(c.hidden_size, c.head_dim, c, quantized=True, axes=(KV_DIM, EMBED))
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        group_in = c.num_attention_heads * c.head_dim // c.o_groups
        # Output groups split with the heads they read (group g holds heads [g*H/G, (g+1)*H/G)).
        self.wo_a = Linear(
            group_in, c.o_groups * c.o_lora_rank, c, quantized=True, axes=(O_GROUP_RANKS, GROUP_HEAD_DIMS)
        )
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, c, quantized=True, axes=(EMBED, O_GROUP_RANKS))
        self.attn_sink = nnx.Param(jnp.zeros((c.num_attention_heads,), jnp.float32), axes=(HEADS,))
        if layer_type != SLIDING:
            self.compressor = Compressor(c, ratio, c.head_dim, overlap=layer_type == CSA)
        if layer_type == CSA:
            self.indexer = Indexer(c, ratio)

    # ---- pieces shared by the whole-sequence forward and the cached step ------------------------
    def queries_and_kv(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # q_latent [b, s, q_lora], q [b, s, H, D], kv [b, s, D]
        batch, seq, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).reshape(batch, seq, self.n_heads, self.head_dim)
        q = rms_normalize(q, self.eps).astype(x.dtype)  # weightless per-head RMSNorm
        q = apply_rope(q, cos, sin, heads_axis=True)
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)  # K = V
        return q_latent, q, kv

    def output(self, out: jax.Array, cos: jax.Array, sin: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """Attention output [b, s, H, D] -> [b, s, hidden]."""
        batch, seq = out.shape[:2]
        # K = V carries RoPE, so the output does too: rotate it back by the query's position.
        out = apply_rope(out.astype(dtype), cos, sin, inverse=True, heads_axis=True)
        # Grouped output projection: group g holds heads [g*H/G, (g+1)*H/G).
        grouped = out.reshape(batch, seq, self.o_groups, -1)
        wo_a = self.wo_a.dequantized(dtype).reshape(self.o_groups, self.o_lora_rank, -1)
        z = jnp.einsum("bsgi,gri->bsgr", grouped, wo_a).reshape(batch, seq, -1)
        return self.wo_b(z)

    # ---- whole sequence: the reference ----------------------------------------------------------
    def __call__(
        self,
        x: jax.Array,  # [batch, seq, hidden] attn_norm output
        cos: jax.Array,  # [seq, rope/2] this layer's table at positions 0..seq-1
        sin: jax.Array,
        options: ForwardOptions,
    ) -> jax.Array:  # [batch, seq, hidden]
        """The layer over a whole sequence at positions 0..seq-1, with no cache: always the dense
        reference attention (`dense_attention`), the numerics `step` must reproduce."""
        q_latent, q, kv = self.queries_and_kv(x, cos, sin)
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
        out = dense_attention(q, kv, compressed, compressed_idx, sinks, window=self.window, ratio=max(self.ratio, 1))
        return self.output(out, cos, sin, x.dtype)

    # ---- one step over the paged cache -----------------------------------------------------------
    def step(
        self,
        x: jax.Array,  # [batch, S, hidden] attn_norm output of each row's chunk
        rotation: tuple[jax.Array, jax.Array, jax.Array],  # cos, sin [batch, S, rope/2]; inv_freq [rope/2]
        cache: PagedKVCache,
        ctx: CacheStep,
        seqs: StepSequences,
        place: LayerPlace,
    ) -> tuple[jax.Array, PagedKVCache]:  # [batch, S, hidden], the cache with this layer's writes
        """The layer on the cache: advance the compressors from their kept rows and write the
        entries they complete (before anything reads them), pick CSA entries with the backend's
        indexer, attend, and only then write the window rows later steps read."""
        cos, sin, inv_freq = rotation
        layout = ctx.layout
        q_latent, q, kv = self.queries_and_kv(x, cos, sin)
        # The chunk's own rows reach the kernel as the pool would return them.
        stored_kv = kv_rounding.kv_cache_round_trip(kv, self.rope_dim) if layout.kv_cache_dtype == FP8_DS_MLA else kv
        pool = table = picks = None
        if self.layer_type != SLIDING:
            pool, slots, cache = self._write_compressed(x, inv_freq, cache, ctx, seqs, place)
            table = seqs.compressed_table
        if self.layer_type == CSA:
            picks, cache = self._pick_csa_entries(x, q_latent, rotation, cache, ctx, seqs, place, slots)
        out, sliding = self._attend(q, stored_kv, pool, table, picks, cache.sliding.kv, ctx, seqs, place)
        cache = dataclasses.replace(cache, sliding=dataclasses.replace(cache.sliding, kv=sliding))
        return self.output(out, cos, sin, x.dtype), cache

    def _write_compressed(
        self, x: jax.Array, inv_freq: jax.Array, cache: PagedKVCache, ctx: CacheStep, seqs: StepSequences,
        place: LayerPlace,
    ) -> tuple[Any, jax.Array, PagedKVCache]:  # pool planes, as PagedKVCache holds them
        """Advance this layer's compressor and write the entries it completes to the CSA or HCA
        pool: (the written pool, the entries' slots, the cache with both)."""
        layout, backend = ctx.layout, ctx.backend
        name = "csa" if self.layer_type == CSA else "hca"
        units = layout.csa_units_per_block if name == "csa" else layout.hca_units_per_block
        entries, windows, cache = self._compress(self.compressor, f"{name}_state", x, inv_freq, cache, seqs, place)
        slots = entry_slots(seqs.compressed_table, windows, units)
        pool = backend.write_kv(getattr(cache.compressed, name), entries.reshape(-1, self.head_dim), slots, place.compressed)
        # Reads see the written pool as a whole: XLA otherwise forwarded the write into the
        # kernel's gather (reading the old pool beside the new entries), so the old pool had
        # to stay readable and was copied whole (HCA, prefill steps; 6144 bytes per block here).
        pool = jax.lax.optimization_barrier(pool)
        return pool, slots, _replace_pool(cache, name, pool)

    def _pick_csa_entries(
        self, x: jax.Array, q_latent: jax.Array, rotation: tuple[jax.Array, jax.Array, jax.Array],
        cache: PagedKVCache, ctx: CacheStep, seqs: StepSequences, place: LayerPlace, slots: jax.Array,
    ) -> tuple[jax.Array, PagedKVCache]:
        """Advance the indexer's compressor, write its keys at the CSA entries' `slots`, and pick
        each query's top-k CSA entries: (the picks, the cache with the keys)."""
        cos, sin, inv_freq = rotation
        backend = ctx.backend
        idx = self.indexer
        keys, _, cache = self._compress(idx.compressor, "csa_indexer_state", x, inv_freq, cache, seqs, place)
        key_pool = backend.write_indexer_keys(cache.compressed.indexer, keys.reshape(-1, idx.head_dim), slots, place.compressed)
        cache = _replace_pool(cache, "indexer", key_pool)
        picks = backend.indexer_topk(
            idx.queries(q_latent, cos, sin), idx.head_weights(x), key_pool, seqs.compressed_table, seqs.start, seqs.lens,
            place.compressed, topk=idx.topk, ratio=self.ratio,
        )
        return picks, cache

    def _attend(
        self, q: jax.Array, stored_kv: jax.Array, pool: Any, table: jax.Array | None, picks: jax.Array | None,
        sliding: Any, ctx: CacheStep, seqs: StepSequences, place: LayerPlace,
    ) -> tuple[jax.Array, Any]:
        """The attention kernel over the window ring and the compressed pool, and the ring with
        the chunk's rows written (before the kernel reads it in decode, after it in prefill):
        (out [batch, S, heads, head_dim], the ring)."""
        layout, backend = ctx.layout, ctx.backend
        sinks = self.attn_sink[...].astype(jnp.float32)
        ratio = self.ratio if pool is not None else 0
        if q.shape[1] == 1:  # decode: the new row goes into the ring first, the kernel reads it there
            sliding = backend.write_kv(sliding, stored_kv.reshape(-1, self.head_dim), window_slots(seqs, layout.block_size, 1), place.sliding)
            decode = functools.partial(backend.decode, window=self.window, ratio=ratio)
            out = heads_over_tensor(decode, (
                q[:, 0], sliding, seqs.sliding_table, seqs.start + seqs.lens, sinks, pool, table,
                None if picks is None else picks[:, 0], place.sliding, place.compressed,
            ), sinks_at=4, head_axis=1)[:, None]
            return out, sliding
        # A chunk: its own rows come in through window_kv; the ring is written afterwards.
        prefill = functools.partial(backend.prefill, window=self.window, ratio=ratio)
        out = heads_over_tensor(prefill, (
            q, sliding, seqs.sliding_table, seqs.start, seqs.lens, sinks, pool, table, picks,
            place.sliding, place.compressed, stored_kv,
        ), sinks_at=5, head_axis=2)
        # The ring is written only once the kernel has read it: without this ordering (the
        # write does not depend on `out`) XLA copied the whole sliding pool, every layer's
        # together, once per layer of each prefill step to keep the old one readable.
        out, sliding = jax.lax.optimization_barrier((out, sliding))
        slots = window_slots(seqs, layout.block_size, self.window)
        sliding = backend.write_kv(sliding, stored_kv.reshape(-1, self.head_dim), slots, place.sliding)
        return out, sliding

    def _compress(self, compressor, state_name, x, inv_freq, cache, seqs, place):
        """Advance `compressor` over the chunk from the rows it kept; store the rows to keep."""
        state = getattr(cache, state_name)
        r = compressor.ratio
        if x.shape[1] == 1:
            # Decode: write the token's row and pool its window in place rather than rebuild and
            # store every kept row (K x ratio rows a sequence: 128 for HCA in Flash, 8 for CSA).
            kv, score = compressor.project(x, seqs.positions)
            state = store_token_row(state, place.compressed, seqs.slots, seqs.start, r, kv[:, 0], score[:, 0])
            completes = ((seqs.start + 1) % r == 0) & (seqs.lens > 0)

            def read_and_pool():
                rows = timeline_rows(state, place.compressed, seqs.slots, seqs.start, r)
                windows = pool_current_window(rows.kv, rows.score, seqs.start, seqs.lens > 0, ratio=r,
                                              overlap=compressor.overlap)
                return windows, compressor.entries(windows, inv_freq, x.dtype)

            if compressor.overlap:
                # CSA (ratio 4): some row of a batch completes its window in most steps, so the
                # rows are read and pooled every step (a cond would cost XLA:GPU a host read of
                # its predicate).
                windows, entries = read_and_pool()
            else:
                # HCA: only a step where some row completes its window reads the 128 rows and
                # pools (one in `ratio` steps of a row); the other branch's windows are all
                # invalid, so nothing is written.
                windows, entries = jax.lax.cond(
                    jnp.any(completes), read_and_pool,
                    lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(read_and_pool)))
        else:
            kept = kept_rows(state, place.compressed, seqs, r)
            entries, windows, kept = compressor.step(x, seqs.positions, seqs.lens, inv_freq, kept)
            state = store_rows(state, place.compressed, seqs.slots, seqs.start + seqs.lens, r, kept)
        return entries, windows, dataclasses.replace(cache, **{state_name: state})


def _replace_pool(cache: PagedKVCache, name: str, planes) -> PagedKVCache:
    return dataclasses.replace(cache, compressed=dataclasses.replace(cache.compressed, **{name: planes}))


def heads_over_tensor(kernel, args: tuple, *, sinks_at: int, head_axis: int) -> jax.Array:
    """`kernel(*args)` (an attention backend's decode or prefill: q first, the sinks at `sinks_at`)
    with the query heads split over the mesh's tensor axis under `jax.shard_map` when the step
    runs on a mesh: a Pallas kernel is opaque to XLA's partitioner, which would otherwise gather
    every head to every device. The pools, tables and picks are the same on every tensor rank (one
    KV head); each rank attends with its own heads. The heads sit on `head_axis` of q and of the
    output."""
    mesh = jax.sharding.get_abstract_mesh()
    if TENSOR not in mesh.axis_names or mesh.shape[TENSOR] == 1 or TENSOR in mesh.manual_axes:
        return kernel(*args)
    heads = P(*([None] * head_axis), TENSOR)
    specs = tuple(heads if i == 0 else P(TENSOR) if i == sinks_at else P() for i in range(len(args)))
    return jax.shard_map(kernel, in_specs=specs, out_specs=heads, axis_names={TENSOR}, check_vma=False)(*args)
