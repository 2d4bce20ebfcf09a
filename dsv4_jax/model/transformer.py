"""The DeepSeek-V4 model: embedding, hc_mult residual streams, the decoder stack, hc_head,
final norm and head (spec 2), plus the MTP block (spec 6).

Layers whose kinds repeat (DeepSeek-V4-Flash: 20 (HCA, CSA) pairs) are stacked and run under
`nnx.scan`, so compile time does not grow with depth.

Two forward paths over the same modules and weights, with two roles:
* `__call__` / `hidden_streams` / `mtp_logits`: the whole sequence at positions 0..seq-1 with no
  cache and the dense reference attention (`attention_core.dense_attention`). It is the model's
  own reference: the parity goldens hold it against transformers and the mutation tests patch its
  functions, so it must not depend on the serving path.
* `step`: the one serving path (the engine's `ModelRunner`), chunks of rows over the paged KV
  cache with attention, KV writes and the indexer's top-k through the runner's
  `pallas_kernels.backend.AttentionBackend`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from flax import nnx

from dsv4_jax.config import SLIDING, DeepseekV4Config
from dsv4_jax.kv_cache.paged import PagedKVCache
from dsv4_jax.model.cache_step import CacheStep, StepSequences
from dsv4_jax.model.block import Block
from dsv4_jax.model.hyper_connection import hc_head
from dsv4_jax.model.layers import Embedding, Linear, RMSNorm
from dsv4_jax.model.options import ForwardOptions
from dsv4_jax.model.rope import layer_frequencies, rope_angles
from dsv4_jax.model.axes import EMBED, HC, LAYERS, VOCAB


@dataclasses.dataclass(frozen=True)
class LayerKind:
    layer_type: str
    ratio: int
    hash_routed: bool


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers [first, first + period * count) as `count` repetitions of `period` kinds."""

    first: int
    kinds: tuple[LayerKind, ...]
    count: int

    @property
    def period(self) -> int:
        return len(self.kinds)

    def layer(self, repetition: int, position: int) -> int:
        return self.first + repetition * self.period + position


def layer_kinds(config: DeepseekV4Config) -> list[LayerKind]:
    return [
        LayerKind(config.layer_type(i), config.compress_ratio(i), config.is_hash_layer(i))
        for i in range(config.num_hidden_layers)
    ]


def plan_segments(kinds: list[LayerKind], stack: bool = True) -> list[Segment]:
    """Greedy split of the layer list into stacked runs (period 2 or 1, >= 2 repetitions)
    and single layers (all single when `stack` is False)."""
    segments, i = [], 0
    while i < len(kinds):
        for period in (2, 1) if stack else ():
            unit = tuple(kinds[i : i + period])
            count = 0
            while tuple(kinds[i + count * period : i + (count + 1) * period]) == unit and len(unit) == period:
                count += 1
            if count >= 2:
                segments.append(Segment(i, unit, count))
                i += period * count
                break
        else:
            segments.append(Segment(i, (kinds[i],), 1))
            i += 1
    return segments


class BlockStack(nnx.Module):
    """`count` repetitions of a unit of blocks, parameters stacked on a leading axis."""

    def __init__(self, config: DeepseekV4Config, segment: Segment):
        self.segment = segment

        def make_unit(_):
            return nnx.List([Block(config, k.layer_type, k.ratio, k.hash_routed) for k in segment.kinds])

        self.units = nnx.vmap(make_unit, in_axes=0, out_axes=0)(jnp.arange(segment.count))
        # nnx.vmap stacks the values, not the declared axes: name the new leading axis.
        for _, variable in nnx.iter_graph(self.units):
            axes = variable.get_metadata().get("axes") if isinstance(variable, nnx.Variable) else None
            if axes is not None:  # undeclared axes stay None, for `sharding.partition_spec` to report
                variable.set_metadata(axes=(LAYERS, *axes))

    def __call__(self, streams, token_ids, tables, options):
        kinds = self.segment.kinds

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, unit):
            for block, kind in zip(unit, kinds):
                cos, sin = tables[kind.layer_type != SLIDING]
                x = block(x, token_ids, cos, sin, options)
            return x

        return run(streams, self.units)

    def step(self, streams, token_ids, rotations, cache, ctx, seqs, places, options):
        """`Block.step` of every layer; the cache is the scan carry and each layer's pool
        indices come in as xs (`places[position]`: int32 [count]), so no pool is copied."""
        kinds = self.segment.kinds

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def run(carry, unit, unit_places):
            x, cache = carry
            for block, kind, place in zip(unit, kinds, unit_places):
                x, cache = block.step(
                    x, token_ids, rotations[kind.layer_type != SLIDING], cache, ctx, seqs, place, options
                )
            return x, cache

        return run((streams, cache), self.units, places)


class MTPBlock(Block):
    """The multi-token-prediction block: a sliding, top-k routed block whose input mixes the
    main model's pre-hc_head streams with the next token's embedding; its own hc_head and norm,
    the main model's embedding and head."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__(config, SLIDING, 0, hash_routed=False)
        c, n = config, config.hc_mult
        self.e_proj = Linear(c.hidden_size, c.hidden_size, c, quantized=True, axes=(EMBED, EMBED))
        self.h_proj = Linear(c.hidden_size, c.hidden_size, c, quantized=True, axes=(EMBED, EMBED))
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_head_fn = nnx.Param(jnp.zeros((n, n * c.hidden_size), jnp.float32), axes=(HC, HC))
        self.hc_head_base = nnx.Param(jnp.zeros((n,), jnp.float32), axes=(HC,))
        self.hc_head_scale = nnx.Param(jnp.zeros((1,), jnp.float32), axes=(HC,))


class DeepseekV4(nnx.Module):
    def __init__(self, config: DeepseekV4Config, mtp: bool = True, stack_layers: bool = True):
        c = self.config = config
        n = c.hc_mult
        self.embed = Embedding(c.vocab_size, c.hidden_size)
        self.segments_plan = plan_segments(layer_kinds(c), stack=stack_layers)
        self.segments = nnx.List(
            [
                BlockStack(c, s) if s.count > 1 else Block(c, *dataclasses.astuple(s.kinds[0]))
                for s in self.segments_plan
            ]
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = Linear(c.hidden_size, c.vocab_size, c, quantized=False, axes=(VOCAB, EMBED), transposed=True)
        self.hc_head_fn = nnx.Param(jnp.zeros((n, n * c.hidden_size), jnp.float32), axes=(HC, HC))
        self.hc_head_base = nnx.Param(jnp.zeros((n,), jnp.float32), axes=(HC,))
        self.hc_head_scale = nnx.Param(jnp.zeros((1,), jnp.float32), axes=(HC,))
        self.mtp = nnx.List([MTPBlock(c) for _ in range(c.num_nextn_predict_layers if mtp else 0)])

    # ---- pieces -------------------------------------------------------------------------
    def rope_frequencies(self) -> tuple[jax.Array, jax.Array]:
        """(sliding layers', compressed layers') inverse frequencies, each [rope/2]."""
        c = self.config
        sliding_layer = c.num_hidden_layers  # the MTP layer index is always sliding
        compressed_layers = [i for i in range(c.num_hidden_layers) if c.compress_ratio(i)]
        main = layer_frequencies(c, sliding_layer)
        compress = layer_frequencies(c, compressed_layers[0]) if compressed_layers else main
        return jnp.asarray(main), jnp.asarray(compress)

    def rope_tables(self, seq: int) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """(main table, compress table) at positions 0..seq-1, each [seq, rope/2]."""
        positions = jnp.arange(seq)
        return tuple(rope_angles(positions, inv_freq) for inv_freq in self.rope_frequencies())

    def input_streams(self, token_ids: jax.Array, options: ForwardOptions) -> jax.Array:
        """[batch, seq] -> [batch, seq, hc_mult, hidden]: each token's embedding in every mHC stream."""
        x = self.embed(token_ids, options.jnp_dtype)
        return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.config.hc_mult, x.shape[-1]))

    def hidden_streams(
        self,
        token_ids: jax.Array,  # [batch, seq] int32, already checked against the vocabulary
        options: ForwardOptions,
    ) -> jax.Array:  # [batch, seq, hc_mult, hidden]: the streams before hc_head
        """The whole-sequence forward's streams (positions 0..seq-1, no cache, dense attention)."""
        streams = self.input_streams(token_ids, options)
        tables = self.rope_tables(token_ids.shape[1])
        for plan, segment in zip(self.segments_plan, self.segments):
            if plan.count > 1:
                streams = segment(streams, token_ids, tables, options)
            else:
                cos, sin = tables[plan.kinds[0].layer_type != SLIDING]
                streams = segment(streams, token_ids, cos, sin, options)
        return streams

    def step(
        self,
        token_ids: jax.Array,  # [batch, S] int32 (padding: any valid id)
        seqs: StepSequences,
        cache: PagedKVCache,
        options: ForwardOptions,
        ctx: CacheStep,
    ) -> tuple[jax.Array, PagedKVCache]:  # streams before hc_head [batch, S, hc_mult, hidden]
        """One step over the paged cache, the serving path: each row's chunk at its own positions,
        reading what earlier steps wrote and writing what later steps read (see `Attention.step`),
        attention through `ctx.backend`."""
        streams = self.input_streams(token_ids, options)
        # The barrier keeps each cos / sin table one array computed once a step: without it XLA
        # fuses the angles into every RoPE site and recomputes cos and sin per element of each
        # rotated tensor (a dsv4-tiny decode step spent ~0.6 of ~12 thread-ms there).
        rotations = tuple((*lax.optimization_barrier(rope_angles(seqs.positions, f)), f) for f in self.rope_frequencies())
        for plan, segment in zip(self.segments_plan, self.segments):
            if plan.count > 1:
                layers = np.array([[plan.layer(k, p) for k in range(plan.count)] for p in range(plan.period)])
                places = tuple(ctx.places(row) for row in layers)
                streams, cache = segment.step(streams, token_ids, rotations, cache, ctx, seqs, places, options)
            else:
                rotation = rotations[plan.kinds[0].layer_type != SLIDING]
                place = ctx.places(np.array(plan.first))
                streams, cache = segment.step(streams, token_ids, rotation, cache, ctx, seqs, place, options)
        return streams, cache

    def logits_from_streams(self, streams: jax.Array, owner: "DeepseekV4 | MTPBlock") -> jax.Array:
        c = self.config
        h = hc_head(
            streams, owner.hc_head_fn[...], owner.hc_head_base[...], owner.hc_head_scale[...],
            norm_eps=c.rms_norm_eps, hc_eps=c.hc_eps,
        )
        h = owner.norm(h)
        return self.head.float32(h)  # logits in fp32

    def __call__(
        self,
        token_ids: jax.Array,
        options: ForwardOptions = ForwardOptions(),
    ) -> jax.Array:
        """[batch, seq] int32 -> logits [batch, seq, vocab] float32 (full sequence, no cache).

        The model's own reference: every layer's attention is the dense `dense_attention`, never
        a KV-cache backend, so the parity goldens and the mutation tests (which patch the model's
        functions) hold it independently of the serving path, `step`."""
        return self.logits_from_streams(self.hidden_streams(token_ids, options), self)

    def mtp_logits(
        self,
        streams: jax.Array,  # [batch, seq, hc_mult, hidden] main-model streams at positions t
        next_ids: jax.Array,  # [batch, seq] the token at t + 1 for each position t
        options: ForwardOptions = ForwardOptions(),
        depth: int = 0,
    ) -> jax.Array:  # [batch, seq, vocab] float32: predictions of the token at t + 2
        mtp = self.mtp[depth]
        dtype = options.jnp_dtype
        e = mtp.enorm(self.embed(next_ids, dtype))
        h = mtp.h_proj(mtp.hnorm(streams.astype(dtype))) + mtp.e_proj(e)[:, :, None, :]
        main_table, _ = self.rope_tables(next_ids.shape[1])
        h = mtp(h, next_ids, *main_table, options)
        return self.logits_from_streams(h, mtp)


    def mtp_step(
        self,
        streams: jax.Array,  # [batch, S, hc_mult, hidden]: the main model's step streams at positions t
        next_ids: jax.Array,  # [batch, S] int32: the token at t + 1 for each position t
        seqs: StepSequences,  # the main step's rows (positions t)
        cache: PagedKVCache,  # a layout with the MTP layers (`num_mtp_layers`)
        options: ForwardOptions,
        ctx: CacheStep,
        depth: int = 0,
    ) -> tuple[jax.Array, PagedKVCache]:  # the MTP block's streams before its hc_head, the cache
        """`mtp_logits` on the paged cache, the drafter's path: the MTP block is a sliding layer
        (the layout's layer num_hidden_layers + depth) with its own window KV, written at the
        main step's positions, so a chunk reads the MTP rows of earlier steps as the main
        layers read theirs. Its logits: `logits_from_streams(streams, self.mtp[depth])`."""
        mtp = self.mtp[depth]
        dtype = options.jnp_dtype
        e = mtp.enorm(self.embed(next_ids, dtype))
        h = mtp.h_proj(mtp.hnorm(streams.astype(dtype))) + mtp.e_proj(e)[:, :, None, :]
        inv_freq = self.rope_frequencies()[0]  # the MTP layer is a sliding layer
        rotation = (*rope_angles(seqs.positions, inv_freq), inv_freq)
        place = ctx.places(np.array(self.config.num_hidden_layers + depth))
        return mtp.step(h, next_ids, rotation, cache, ctx, seqs, place, options)


def check_token_ids(token_ids: np.ndarray, vocab_size: int) -> None:
    """JAX clamps out-of-range gathers silently, so ids are checked on the host."""
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        bad = token_ids[(token_ids < 0) | (token_ids >= vocab_size)]
        raise ValueError(f"token ids must be in [0, {vocab_size}); got {sorted(set(bad.tolist()))[:8]}")
