"""The model runner: the device side of the engine.

It owns the weights (the model split once into graph and state), the paged KV cache and the
jitted step functions. A step runs one group of rows `[B, S]`: each row a chunk of one sequence
at its own positions (S = 1 is a decode step). Shapes come from a short bucket list, so each
step function compiles once per bucket at warm-up (several buckets at once, on threads; steps
then call those executables) and never again: rows are padded to the
bucket's B (padding rows read and write nothing) and tokens to its S. Decode-only steps use the
decode buckets and never pay for prefill padding; decode tokens that share a step with prefill
chunks ride along as rows of one real token.

The host builds each step's arrays in numpy and hands them to the jitted step as they are (on a
mesh: one `device_put` onto the rows' sharding first); decode token ids may instead come
straight from the previous step's device output. The weights go in as a flat list of arrays.
The cache is donated to every step, so XLA updates it in place (warm-up checks that the
donation took effect).

On a mesh (the model's `options.mesh`, `dsv4_jax.parallel.sharding`) the step runs under `jax.shard_map`
over the data axis: each data-parallel rank has its own block pools, sequence slots and rows (a
bucket is per rank: a step holds data x B rows, rank r's in rows [r B, (r + 1) B)), block ids in
its tables are its own, and no pool ever crosses devices. Inside a rank the tensor axis is left
to XLA (query heads, the output projection and the vocabulary split over it; the one KV head is
replicated), and the routed experts run under their own shard_map (`model.moe`). A rank with
nothing to run computes padding rows in the same step: ranks stay in lockstep, so no collective
waits on an idle one.

Imports: only what the GPU machine has (jax, flax, numpy and this repository).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from dsv4_jax.engine.compiles import CompileCounter, ProgramMemory, compile_threads
from dsv4_jax.engine.program_cache import ProgramCache, describe
from dsv4_jax.engine.host_memory import keep_freed_buffers
from dsv4_jax.engine.sampler import prompt_scores
from dsv4_jax.engine.sampling_params import MAX_LOGPROBS
from dsv4_jax.kv_cache.paged import PagedCacheLayout, PagedKVCache, init_paged_cache, kv_planes, partition_specs
from dsv4_jax.kv_cache.snapshots import (
    PrefixSnapshots, abstract_snapshots, copy_entries, init_snapshots, restore_snapshots, snapshot_partition_specs,
    take_snapshots,
)
from dsv4_jax.model.cache_step import CacheStep, StepSequences
from dsv4_jax.model.axes import DATA
from pallas_kernels.backend import XLA, get_backend

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    """Padded step shapes: prefill (rows, tokens per row) pairs and decode row counts; with
    speculative decoding, verify (rows, k + 1) pairs (`with_verify_rows`), which serve any step
    they hold but are no prefill bucket (the scheduler sizes its chunks from `prefill`)."""

    prefill: tuple[tuple[int, int], ...] = ((4, 64), (8, 256))
    decode: tuple[int, ...] = (8, 32)
    verify: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for rows, tokens in (*self.prefill, *self.verify):
            if not (isinstance(rows, int) and isinstance(tokens, int) and rows >= 1 and tokens >= 2):
                raise ValueError(f"prefill buckets are (rows >= 1, tokens >= 2) pairs, got {(rows, tokens)!r}")
        if not self.prefill or not self.decode or any(not isinstance(b, int) or b < 1 for b in self.decode):
            raise ValueError(f"need at least one prefill and one decode bucket, got {self!r}")
        object.__setattr__(self, "prefill", tuple(sorted(self.prefill, key=lambda b: (b[0] * b[1], b))))
        object.__setattr__(self, "decode", tuple(sorted(self.decode)))
        verify = sorted(set(self.verify) - set(self.prefill), key=lambda b: (b[0] * b[1], b))
        object.__setattr__(self, "verify", tuple(verify))

    def pick(self, rows: int, longest: int) -> tuple[int, int]:
        """The smallest bucket (B, S) holding `rows` rows of up to `longest` tokens."""
        if longest == 1:
            for b in self.decode:
                if b >= rows:
                    return b, 1
        for b, s in sorted((*self.prefill, *self.verify), key=lambda b: (b[0] * b[1], b)):
            if b >= rows and s >= longest:
                return b, s
        raise ValueError(
            f"a step of {rows} rows with up to {longest} tokens fits no bucket (prefill {self.prefill}, "
            f"verify {self.verify}, decode {self.decode}): the scheduler must split it"
        )

    @property
    def all(self) -> tuple[tuple[int, int], ...]:
        return (*self.prefill, *self.verify, *((b, 1) for b in self.decode))

    def with_verify_rows(self, num_speculative_tokens: int) -> StepBuckets:
        """These buckets with a (B, k + 1) verify bucket for each decode bucket B: the steps of
        speculative decoding, whose rows are a token and up to k drafts."""
        k = num_speculative_tokens
        return dataclasses.replace(self, verify=tuple((b, k + 1) for b in self.decode)) if k else self

    def with_min_decode_rows(self, rows: int) -> StepBuckets:
        """These buckets with every decode bucket at least `rows` rows (merging any that meet)."""
        return dataclasses.replace(self, decode=tuple(sorted({max(b, rows) for b in self.decode})))


# Snapshot copies one device call makes per data-parallel rank at most (`ModelRunner.copies_per_rank`).
COPIES_PER_CALL = 8

# Rows of a decode step at least, on CPUs: XLA:CPU runs a one-row bf16 matmul by converting the
# whole weight to float32 first (YNNPACK takes two rows and up), which made a one-row decode step
# of the mid-size benchmark model slower than a two-row one (165 vs 106 ms).
CPU_MIN_DECODE_ROWS = 2


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One row of a step: a chunk of one sequence."""

    slot: int  # the sequence's slot (its sliding ring and compressor state)
    start: int  # position of the chunk's first token
    token_ids: Sequence[int]  # the chunk (one token for a decode)
    compressed_blocks: Sequence[int]  # the sequence's compressed block ids, in order (from the scheduler: C ints)
    dp_rank: int = 0  # the data-parallel rank whose pools hold the sequence (slot and blocks are its)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    # [B * n, vocab] float32, n = min(num_speculative_tokens + 1, S): the logits of each row's
    # last n positions, row b's last real token at b * n + n - 1 (positions before a row's first
    # repeat its first; padding rows: garbage). Without speculation, and in decode buckets, n = 1:
    # [B, vocab], the last token's.
    logits: jax.Array
    streams: jax.Array  # [B, S, hc_mult, hidden] before hc_head, for prompt logprobs and MTP
    rows: int  # real rows (`ModelRunner.row_positions` says where)
    bucket: tuple[int, int]  # (B, S) of the whole step: data-parallel ranks x the rank's bucket rows


class BucketMemory(NamedTuple):
    """What one bucket's programs need on a device besides the weights and the cache."""

    step: ProgramMemory  # the step: its scratch, its logits and streams
    scores: ProgramMemory | None  # prompt scoring of its streams (prefill buckets)
    logits: jax.ShapeDtypeStruct  # the step's logits [B, vocab], as the sampler gets them


def step_compiler_options() -> dict[str, str]:
    """XLA options of the step: without the HLO rematerialization pass, besides any passes
    XLA_FLAGS already disables (an option given here replaces that list). XLA:GPU runs the pass
    against a limit of the device's memory, and its points-to analysis takes each in-place update
    of the donated pools for a new buffer: on an H200 every step program seemed to need about
    twice its pools (125 GiB against 69.48 GiB), the pass rematerialized nothing and
    spent the step's compile scanning for candidates (O(instructions^2) once over the limit).
    Buffer assignment updates the pools in place, and what a step needs besides them is measured
    from it (`program_memory`)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    passes = [p for f in flags if f.startswith("--xla_disable_hlo_passes=")
              for p in f.split("=", 1)[1].split(",") if p]
    return {"xla_disable_hlo_passes": ",".join(dict.fromkeys([*passes, "rematerialization"]))}


def _step(graphdef, weights_def, options, ctx, num_logits, weights, cache, token_ids, seqs):
    model = nnx.merge(graphdef, jax.tree.unflatten(weights_def, weights))
    streams, cache = model.step(token_ids, seqs, cache, options, ctx)
    num_logits = min(num_logits, token_ids.shape[1])  # a decode bucket's rows have one position
    back = jnp.arange(num_logits - 1, -1, -1, dtype=jnp.int32)  # the last num_logits positions, in order
    at = jnp.maximum(seqs.lens[:, None] - 1 - back[None, :], 0)
    final = jnp.take_along_axis(streams, at[:, :, None, None], axis=1)  # [B, n, hc, hidden]
    logits = model.logits_from_streams(final, model)  # [B, n, vocab]
    return logits.reshape(-1, logits.shape[-1]), streams, cache


def _draft(graphdef, weights_def, options, ctx, num_drafts, weights, cache, streams, next_ids, seqs, draft_at):
    """Speculative decoding's drafter: the MTP block over a step's rows (its window KV written at
    the step's positions, `DeepseekV4.mtp_step`), then `num_drafts` greedy drafts per row: the
    argmax of its logits at `draft_at` [B] (the row's last accepted position q, whose next token,
    sampled by the step, is next_ids[q]), then the block applied again on its own output at
    q + 1, q + 2, ... (vLLM's MTP drafting for k > 1). Returns the drafts [B, num_drafts] and the cache."""
    model = nnx.merge(graphdef, jax.tree.unflatten(weights_def, weights))
    mtp = model.mtp[0]
    h, cache = model.mtp_step(streams, next_ids, seqs, cache, options, ctx)  # [B, S, hc, hidden]
    h = jnp.take_along_axis(h, draft_at[:, None, None, None], axis=1)  # [B, 1, hc, hidden]
    drafts = [jnp.argmax(model.logits_from_streams(h, mtp)[:, 0], axis=-1).astype(jnp.int32)]
    real = seqs.lens > 0
    for j in range(1, num_drafts):
        position = seqs.start + draft_at + j
        one = dataclasses.replace(seqs, positions=position[:, None], lens=real.astype(jnp.int32))
        h, cache = model.mtp_step(h, drafts[-1][:, None], one, cache, options, ctx)
        drafts.append(jnp.argmax(model.logits_from_streams(h, mtp)[:, 0], axis=-1).astype(jnp.int32))
    return jnp.stack(drafts, axis=1), cache


def _head(graphdef, weights_def, weights, streams):
    model = nnx.merge(graphdef, jax.tree.unflatten(weights_def, weights))
    return model.logits_from_streams(streams, model)


# Positions one pass of the head scores for prompt logprobs: a pass holds its [positions, vocab]
# float32 logits (1024 x 129,280: 0.5 GB), where the whole step's would be 4.2 GB for an 8192-token
# prefill, outside what the KV planner leaves free.
PROMPT_SCORE_POSITIONS = 1024


def _head_scores(graphdef, weights_def, weights, streams, targets, *, positions=PROMPT_SCORE_POSITIONS):
    """`prompt_scores` of every position of a step's streams [B, S, hc, hidden] against targets
    [B, S], `positions` at a time: ([B, S], [B, S], [B, S, k], [B, S, k]), k = MAX_LOGPROBS."""
    b, s = targets.shape
    n = b * s
    chunk = min(positions, n)
    passes = -(-n // chunk)
    rest = streams.shape[2:]  # (hc_mult, hidden)
    flat = jnp.pad(streams.reshape(n, *rest), ((0, passes * chunk - n),) + ((0, 0),) * len(rest))
    flat_targets = jnp.pad(targets.reshape(n), (0, passes * chunk - n))

    def score(part):
        part_streams, part_targets = part  # [chunk, hc, hidden], [chunk]: one position per row
        logits = _head(graphdef, weights_def, weights, part_streams[:, None])[:, 0]  # [chunk, vocab] float32
        return prompt_scores(logits, part_targets, MAX_LOGPROBS)

    scores = jax.lax.map(score, (flat.reshape(passes, chunk, *rest), flat_targets.reshape(passes, chunk)))
    return tuple(x.reshape(passes * chunk, *x.shape[2:])[:n].reshape(b, s, *x.shape[2:]) for x in scores)


def _data_specs(tree):
    """Per leaf, the data-axis part of its sharding (the specs of a shard_map manual over data):
    a dimension split over (data, tensor) is a contiguous block per data rank, split over tensor
    inside it."""

    def spec(leaf):
        sharding = getattr(leaf, "sharding", None)
        parts = getattr(sharding, "spec", ())
        data = [DATA if p == DATA or (isinstance(p, tuple) and p and p[0] == DATA) else None for p in parts]
        return P(*data)

    return jax.tree.map(spec, tree)


def _ragged_columns(lengths: np.ndarray) -> np.ndarray:
    """Column indices 0..n-1 of each row, rows of `lengths` n, concatenated: [sum(lengths)]."""
    ends = np.cumsum(lengths)
    return np.arange(ends[-1]) - np.repeat(ends - lengths, lengths)


class ModelRunner:
    """Runs steps of a loaded model (`dsv4_jax.load_model`) over a paged cache of `layout` (one
    data-parallel rank's pools; on a mesh every rank has its own of that size)."""

    def __init__(
        self,
        model,  # dsv4_jax.weights.loading.CausalLM
        layout: PagedCacheLayout,
        *,
        attention_backend: str = XLA,
        buckets: StepBuckets = StepBuckets(),
        allocate_cache: bool = True,
        interpret: bool | None = None,
        programs: ProgramCache | None = None,
        num_prefix_snapshots: int = 0,
        num_speculative_tokens: int = 0,
        mtp_drafts: bool = False,
    ):
        """`allocate_cache=False`: the cache is only its shapes (the step's shard_map places it), for
        `program_memory` of pools that need not fit beside the ones in use; such a runner is for
        that alone (it cannot run steps). `interpret`: run a Pallas backend's kernels in the Pallas
        interpreter (None: only where JAX's default backend is the CPU); on a GPU, the GPU check
        compares the compiled kernels with the same kernels interpreted. `num_prefix_snapshots`:
        the prefix cache's snapshots per data-parallel rank (0: prefix caching off), copied by
        `take_snapshots` and `restore_snapshots` (kv_cache/snapshots.py). `num_speculative_tokens`
        k > 0: steps give each row's last k + 1 logits (`StepOutput.logits`) and the buckets get
        verify buckets (`StepBuckets.with_verify_rows`); with `mtp_drafts`, `draft` runs the MTP
        block after each step (the layout must hold its window pool, `num_mtp_layers`)."""
        self.config = model.config
        self.layout = layout
        self.num_speculative_tokens = num_speculative_tokens
        self.mtp_drafts = bool(mtp_drafts and num_speculative_tokens)
        if self.mtp_drafts and self.config.num_hidden_layers not in layout.sliding_layers:
            raise ValueError("MTP drafts need the MTP layer's window pool: a layout with num_mtp_layers=1")
        if num_speculative_tokens and not layout.spare_compressor_windows and (layout.csa_layers or layout.hca_layers):
            raise ValueError("speculative decoding needs a layout with spare_compressor_windows=1 (a rejected draft "
                             "may take a sequence back into the compressor's window before)")
        on_cpu = jax.default_backend() == "cpu"
        widened = buckets.with_min_decode_rows(CPU_MIN_DECODE_ROWS) if on_cpu else buckets
        self.buckets = widened.with_verify_rows(num_speculative_tokens)
        # On CPUs each step's buffers come from malloc: keep their pages between steps.
        self.keeps_freed_buffers = on_cpu and keep_freed_buffers()
        if widened != buckets:
            logger.info("decode buckets %s run as %s: on CPUs a decode step has at least %d rows",
                        buckets.decode, widened.decode, CPU_MIN_DECODE_ROWS)
        self.backend = get_backend(attention_backend, interpret=interpret)
        # Compiled steps and prompt scoring, read back from disk on a restart (none kept: None).
        self.programs = programs if programs is not None else ProgramCache.default()
        self.graphdef = model.graphdef
        # Steps take the weights as a flat list of arrays: flattening the nnx State on every call
        # (a Python callback per variable) cost ~0.5 ms of each dispatch (dsv4-tiny, 158 weights),
        # which on a 2-core CPU comes out of the device's time.
        self.weights, weights_def = jax.tree.flatten(model.state)
        self.mesh = model.options.mesh
        self.dp = self.mesh.shape[DATA] if self.mesh is not None else 1
        self.ctx = CacheStep(layout, self.backend)
        self.warm = False
        self.cache: PagedKVCache = self._new_cache() if allocate_cache else jax.eval_shape(self._new_cache)
        self.num_prefix_snapshots = num_prefix_snapshots
        self.snapshots: PrefixSnapshots | None = None
        if num_prefix_snapshots:
            self.snapshots = self._new_snapshots() if allocate_cache else jax.eval_shape(self._new_snapshots)
        self.compiles = CompileCounter()  # counts from here: the cache's allocation is not a step's
        # One jitted function each; the cache is donated. `compile_buckets` compiles every bucket's
        # step and prompt scoring ahead of time, and steps then call those executables (keyed by
        # the whole step's (B, S)); a shape without one (a runner not warmed up) compiles on call.
        self._step = jax.jit(self._step_function(weights_def, model.options), donate_argnums=1,
                             compiler_options=step_compiler_options())
        # What the step's and the scoring's traces depend on besides their arguments (program_cache.py).
        self._program_settings = dict(config=self.config, options=model.options, layout=layout,
                                      backend=(self.backend.name, interpret, jax.default_backend()),
                                      compiler_options=step_compiler_options(),
                                      num_speculative_tokens=num_speculative_tokens)
        self._steps: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._scorers: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._drafters: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._draft = jax.jit(self._draft_function(weights_def, model.options), donate_argnums=1,
                              compiler_options=step_compiler_options()) if self.mtp_drafts else None
        self.weights_def = weights_def  # the weights' tree structure (`weights` is its flat leaves)
        self._jit_head_programs()
        self._jit_snapshot_programs()

    def _jit_head_programs(self) -> None:
        """The head over a step's streams (`head`, `prompt_scores`) and `gather`. On a mesh, step
        rows go over the data axis, and what the host reads is made whole on every device first
        where the host needs it, with several processes (each holds only its own devices' part)."""
        replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
        whole = replicated if jax.process_count() > 1 else None
        self._rows = None if self.mesh is None else NamedSharding(self.mesh, P(DATA))
        self._head = jax.jit(functools.partial(_head, self.graphdef, self.weights_def), out_shardings=whole)
        self._head_scores = jax.jit(functools.partial(_head_scores, self.graphdef, self.weights_def),
                                    out_shardings=whole)
        self._gather = jax.jit(lambda x: x, out_shardings=replicated)

    def _jit_snapshot_programs(self) -> None:
        """The prefix cache's two copies (taken after a step, restored before one), each of up to
        `copies_per_rank` entries per rank; on a mesh under a shard_map over the data axis, as the
        step: every rank copies between its own slots and snapshots."""
        self._copies: dict[str, jax.stages.Compiled] = {}
        if not self.num_prefix_snapshots:
            return
        take = functools.partial(take_snapshots, self.layout)
        restore = functools.partial(restore_snapshots, self.layout)
        if self.mesh is not None:
            cache_specs = partition_specs(self._whole_layout(), DATA)
            snap_specs = snapshot_partition_specs(self.snapshots, DATA)
            rows = P(DATA)
            take = jax.shard_map(take, mesh=self.mesh, in_specs=(cache_specs, snap_specs, rows, rows, rows),
                                 out_specs=snap_specs, axis_names={DATA}, check_vma=False)
            restore = jax.shard_map(restore, mesh=self.mesh, in_specs=(cache_specs, snap_specs, rows, rows, rows),
                                    out_specs=cache_specs, axis_names={DATA}, check_vma=False)
        self._take = jax.jit(take, donate_argnums=1)
        self._restore = jax.jit(restore, donate_argnums=0)

    @property
    def copies_per_rank(self) -> int:
        """Snapshot copies one call makes per rank at most (more are split over several calls): a
        call's scratch holds that many snapshots (V4-Flash fp8: ~4.7 MiB each), so it stays small."""
        return min(COPIES_PER_CALL, max(rows for rows, _ in self.buckets.all))

    def _new_snapshots(self) -> PrefixSnapshots:
        """Every rank's snapshots, each allocated on its own devices (never all on one first)."""
        count = self.num_prefix_snapshots * self.dp
        if self.mesh is None:
            return init_snapshots(self.layout, count)
        specs = snapshot_partition_specs(abstract_snapshots(self.layout, count), DATA)
        return init_snapshots(self.layout, count, jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs,
                                                                is_leaf=lambda x: isinstance(x, P)))

    def _copy_args(self, entries: Sequence[tuple[int, int, int, int]]) -> tuple:
        return self._put(copy_entries(list(entries), self.dp, self.copies_per_rank))

    def take_snapshots(self, entries: Sequence[tuple[int, int, int, int]]) -> None:
        """Snapshot (rank, slot, snapshot id, boundary) entries: each slot's state at its block
        boundary, right after the step that ended there (the device runs calls in order)."""
        for part in self._copy_calls(entries):
            self.snapshots = self._copies.get("take", self._take)(self.cache, self.snapshots, *part)

    def restore_snapshots(self, entries: Sequence[tuple[int, int, int, int]]) -> None:
        """Restore (rank, slot, snapshot id, boundary) entries into slots about to resume there."""
        for part in self._copy_calls(entries):
            self.cache = self._copies.get("restore", self._restore)(self.cache, self.snapshots, *part)

    def _copy_calls(self, entries: Sequence[tuple[int, int, int, int]]) -> list[tuple]:
        """The arguments of each call copying `entries`, at most `copies_per_rank` a rank per call
        (one call of padding entries for none)."""
        per_rank: dict[int, list] = {}
        for entry in entries:
            per_rank.setdefault(entry[0], []).append(entry)
        k = self.copies_per_rank
        calls = max([-(-len(e) // k) for e in per_rank.values()], default=1)
        return [self._copy_args([e for rank_entries in per_rank.values() for e in rank_entries[i * k : (i + 1) * k]])
                for i in range(calls)]

    def _compile_snapshot_programs(self, on_done: Callable[[], None] | None) -> None:
        if not self.num_prefix_snapshots or self._copies:
            return
        args = (self.cache, self.snapshots, *self._copy_args([]))
        jobs = {name: (describe(f"{name} snapshots", args, **self._program_settings), functools.partial(fn.lower, *args))
                for name, fn in (("take", self._take), ("restore", self._restore))}
        self._copies.update(self.programs.compile(jobs, on_done=on_done))

    def _step_function(self, weights_def, options) -> Callable:
        """The pure step over (weights, cache, token ids, rows); on a mesh, under a shard_map manual
        over the data axis, every rank's pools side by side and split over it."""
        step = functools.partial(_step, self.graphdef, weights_def, options, self.ctx, self.num_speculative_tokens + 1)
        return self._over_data(step, ("rows", "seqs"), ("rows", "rows"))

    def _draft_function(self, weights_def, options) -> Callable:
        """The pure drafter (`_draft`); on a mesh under a shard_map over the data axis, as the step."""
        draft = functools.partial(_draft, self.graphdef, weights_def, options, self.ctx, self.num_speculative_tokens)
        return self._over_data(draft, ("rows", "rows", "seqs", "rows"), ("rows",))

    def _over_data(self, fn: Callable, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Callable:
        """`fn(weights, cache, *inputs) -> (*outputs, cache)`; on a mesh under a shard_map manual over
        the data axis, every rank's pools side by side and split over it, each input and output
        split by rows ("rows": an array, "seqs": a StepSequences)."""
        if self.mesh is None:
            return fn
        cache_specs = partition_specs(self._whole_layout(), DATA)
        rows = P(DATA)
        spec = {"rows": rows, "seqs": StepSequences(rows, rows, rows, rows, rows)}
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=(_data_specs(self.weights), cache_specs, *(spec[i] for i in inputs)),
            out_specs=(*(spec[o] for o in outputs), cache_specs), axis_names={DATA}, check_vma=False,
        )

    @property
    def logits_sharding(self) -> jax.sharding.Sharding:
        """Where a step's logits [rows, vocab] lie: on the device, or split by rows over the data axis."""
        return self._rows if self.mesh is not None else SingleDeviceSharding(jax.local_devices()[0])

    def _whole_layout(self) -> PagedCacheLayout:
        """Every data-parallel rank's pools side by side (the layout itself without a mesh)."""
        lay = self.layout
        return dataclasses.replace(lay, num_seq_slots=lay.num_seq_slots * self.dp,
                                   num_sliding_blocks=lay.num_sliding_blocks * self.dp,
                                   num_compressed_blocks=lay.num_compressed_blocks * self.dp, data_parallel=self.dp)

    def _new_cache(self) -> PagedKVCache:
        if self.mesh is None:
            return init_paged_cache(self.layout)
        return init_paged_cache(self._whole_layout(), self.mesh, DATA)

    def ensure_cache(self) -> None:
        """A fresh cache if a step call consumed this one without returning its successor (the
        call is donated its cache: an exception, or Ctrl-C, between the call and the assignment).
        Nothing the cache held is needed then: every request was aborted (LLMEngine.reset)."""
        leaves = jax.tree.leaves(self.cache)
        lost = any(leaf.is_deleted() for leaf in leaves)
        if not lost:
            try:
                jax.block_until_ready(leaves)
            except Exception:  # noqa: BLE001 - a device error a GPU reports only when the buffer is read
                lost = True
        if lost:
            logger.warning("the KV cache was consumed or broken by a step that did not complete: allocating it again")
            for leaf in leaves:  # freed first: the pools fill the memory planned for one cache
                try:
                    leaf.delete()
                except Exception:  # noqa: BLE001 - already gone
                    pass
            self.cache = leaves = None
            self.cache = self._new_cache()
        if self.snapshots is not None and any(leaf.is_deleted() for leaf in jax.tree.leaves(self.snapshots)):
            self.snapshots = self._new_snapshots()  # taken by a copy that did not complete: none is needed now

    def probe(self) -> None:
        """One step of padding rows in the smallest bucket, waited for: raises when the device or
        the cache can no longer run a step (after a failed step)."""
        rank_rows, s = min(self.buckets.all, key=lambda bucket: bucket[0] * bucket[1])
        self._run_padding_step((rank_rows * self.dp, s))

    def _run_padding_step(self, bucket: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
        """A step of padding rows only (it reads and writes nothing), waited for: (logits, streams)."""
        out = self._steps.get(bucket, self._step)(self.weights, self.cache, *self._put(self.padding_step(bucket)))
        self.cache = out[2]
        jax.block_until_ready(out)
        return out[0], out[1]

    # ---- host batches -------------------------------------------------------------------------
    def build(self, rows: Sequence[StepRow]) -> tuple[tuple[int, int], np.ndarray, StepSequences]:
        """Host arrays of a step (numpy): the whole step's bucket, token ids [B, S] and the row
        arrays; rows sit where `row_positions` says."""
        if not rows:
            raise ValueError("a step needs at least one row")
        lay = self.layout
        ring, per_seq = lay.sliding_ring, lay.max_blocks_per_seq
        # Whole columns at once rather than numpy calls per row: a 32-row decode step's arrays
        # took ~0.85 ms row by row (dsv4-tiny), host time that a CPU takes from the step.
        n = len(rows)
        lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, n)
        starts = np.fromiter((r.start for r in rows), np.int64, n)
        slots = np.fromiter((r.slot for r in rows), np.int64, n)
        nblocks = np.fromiter((len(r.compressed_blocks) for r in rows), np.int64, n)
        ranks = self._ranks(rows)
        b, s = self.buckets.pick(int(np.bincount(ranks, minlength=self.dp).max()), int(lens.max()))
        b *= self.dp
        capacity = per_seq * lay.block_size
        no_tokens, bad_slot = lens == 0, (slots < 0) | (slots >= lay.num_seq_slots)
        outside, too_many = (starts < 0) | (starts + lens > capacity), nblocks > per_seq
        bad = no_tokens | bad_slot | outside | too_many
        if bad.any():  # the first bad row, and what is wrong with it
            i = int(np.argmax(bad))
            row = rows[i]
            if no_tokens[i]:
                raise ValueError(f"row {i} (slot {row.slot}) has no tokens")
            if bad_slot[i]:
                raise ValueError(f"row {i}: slot {row.slot} is outside [0, {lay.num_seq_slots})")
            if outside[i]:
                raise ValueError(f"row {i}: positions {row.start}..{row.start + lens[i] - 1} are outside the "
                                 f"{capacity} a sequence can hold")
            raise ValueError(f"row {i}: {nblocks[i]} blocks exceed {per_seq} per sequence")
        at = self._positions(ranks, b)
        tokens = np.zeros((b, s), np.int32)
        if s == 1:
            tokens[at, 0] = [r.token_ids[0] for r in rows]
        else:
            tokens[np.repeat(at, lens), _ragged_columns(lens)] = np.fromiter(
                itertools.chain.from_iterable(r.token_ids for r in rows), np.int32, int(lens.sum()))
        row_start, row_lens, row_slots = np.zeros(b, np.int32), np.zeros(b, np.int32), np.full(b, -1, np.int32)
        row_start[at], row_lens[at], row_slots[at] = starts, lens, slots
        sliding = np.full((b, ring), -1, np.int32)
        sliding[at] = slots[:, None] * ring + np.arange(ring)
        compressed = np.full((b, per_seq), -1, np.int32)
        # Row by row: a block list is long (up to max_blocks_per_seq) and, from the scheduler, C
        # ints (`array.array`) copied whole (32 rows x 4096 blocks: the whole build 8.7 -> 0.29 ms
        # against one ragged column of Python ints).
        for a, blocks, k in zip(at.tolist(), (r.compressed_blocks for r in rows), nblocks.tolist()):
            compressed[a, :k] = blocks
        positions = np.arange(s, dtype=np.int32) + row_start[:, None]
        return (b, s), tokens, StepSequences(positions, row_lens, row_slots, sliding, compressed)

    def padding_step(self, bucket: tuple[int, int]) -> tuple[np.ndarray, StepSequences]:
        """Host arrays of a step of padding rows only (it reads and writes nothing): token ids
        [B, S] and the row arrays, for warm-up and ahead-of-time lowering."""
        b, s = bucket
        return np.zeros((b, s), np.int32), StepSequences(
            np.tile(np.arange(s, dtype=np.int32), (b, 1)), np.zeros(b, np.int32), np.full(b, -1, np.int32),
            np.full((b, self.layout.sliding_ring), -1, np.int32),
            np.full((b, self.layout.max_blocks_per_seq), -1, np.int32),
        )

    def row_positions(self, rows: Sequence[StepRow], step_rows: int) -> list[int]:
        """The row of the step's arrays ([step_rows, ...]) that each of `rows` occupies: its rank's
        block of rows, in order."""
        return self._positions(self._ranks(rows), step_rows).tolist()

    def _ranks(self, rows: Sequence[StepRow]) -> np.ndarray:
        ranks = np.fromiter((getattr(r, "dp_rank", 0) for r in rows), np.int64, len(rows))
        bad = (ranks < 0) | (ranks >= self.dp)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"row {i}: data-parallel rank {ranks[i]} is outside [0, {self.dp})")
        return ranks

    def _positions(self, ranks: np.ndarray, step_rows: int) -> np.ndarray:
        """Row i goes to rank r = ranks[i]'s block of step_rows / dp rows, after the earlier rows of r."""
        if self.dp == 1:
            return np.arange(len(ranks))
        order = np.argsort(ranks, kind="stable")
        within = np.empty(len(ranks), np.int64)
        within[order] = np.arange(len(ranks)) - np.searchsorted(ranks[order], ranks[order])
        return ranks * (step_rows // self.dp) + within

    # ---- device -------------------------------------------------------------------------------
    def step(self, rows: Sequence[StepRow], token_ids: jax.Array | None = None) -> StepOutput:
        """Run one step. `token_ids` ([B, S] on the device, e.g. the previous step's samples)
        replaces the rows' own ids when given."""
        return self.run(*self.build(rows), len(rows), token_ids)

    def run(self, bucket: tuple[int, int], tokens: np.ndarray, seqs: StepSequences, rows: int,
            token_ids: jax.Array | None = None) -> StepOutput:
        """`step` on arrays already built by `build` (for a caller that needed them first)."""
        if token_ids is not None:
            if tuple(token_ids.shape) != bucket:
                raise ValueError(f"token_ids has shape {tuple(token_ids.shape)}, the step's bucket is {bucket}")
            tokens_dev, seqs_dev = token_ids.astype(jnp.int32), self._put(seqs)
            if self._rows is not None:
                # On the rows' sharding too (a device-side move): the step's inputs always look the
                # same, so it never compiles a second executable for them.
                tokens_dev = jax.device_put(tokens_dev, self._rows)
        else:
            tokens_dev, seqs_dev = self._put((tokens, seqs))
        logits, streams, self.cache = self._steps.get(bucket, self._step)(self.weights, self.cache, tokens_dev, seqs_dev)
        return StepOutput(logits, streams, rows, bucket)

    def draft(self, streams: jax.Array, seqs: StepSequences, next_ids: np.ndarray, draft_at: np.ndarray
              ) -> jax.Array:
        """The MTP block's drafts after a step (`_draft`), from its `streams` and its host row
        arrays `seqs` (`build`'s): next_ids [B, S] int32, the token after each position of the
        step's rows (the sampled one after the last accepted), and draft_at [B] int32, the index of
        each row's last accepted position. Returns the drafts [B, num_speculative_tokens] int32 on
        the device."""
        if self._draft is None:
            raise RuntimeError("this runner drafts nothing: ModelRunner(num_speculative_tokens=k, mtp_drafts=True)")
        seqs, next_ids, draft_at = self._put((seqs, next_ids.astype(np.int32), draft_at.astype(np.int32)))
        drafts, self.cache = self._drafters.get(tuple(next_ids.shape), self._draft)(
            self.weights, self.cache, streams, next_ids, seqs, draft_at)
        return drafts

    def _put(self, host_arrays):
        """A step's host arrays as the step takes them. Without a mesh the numpy arrays go to the
        jitted call as they are (it moves them itself: ~0.35 ms a step less than a `device_put`
        first, dsv4-tiny on CPU); on a mesh, one transfer onto the rows' sharding."""
        return host_arrays if self._rows is None else jax.device_put(host_arrays, self._rows)

    def all_logits(self, output: StepOutput) -> jax.Array:
        """Logits at every position of a step's rows, [B, S, vocab] (prompt logprobs): a separate
        head call, so ordinary steps compute the head for the last position only."""
        return self.head(output.streams)

    def head(self, streams: jax.Array) -> jax.Array:
        """`all_logits` of a step's streams [B, S, hc_mult, hidden] -> [B, S, vocab] (whole on every
        device with several processes)."""
        return self._head(self.weights, streams)

    def prompt_scores(self, streams: jax.Array, targets: np.ndarray
                      ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Prompt logprobs of a prefill step (`sampler.prompt_scores` at every position): streams
        [B, S, hc_mult, hidden], targets [B, S] int32 (the token each position predicts) ->
        logprob [B, S], rank [B, S], top ids [B, S, MAX_LOGPROBS], top logprobs [B, S, MAX_LOGPROBS]
        (whole on every device with several processes)."""
        return self._scorers.get(tuple(targets.shape), self._head_scores)(self.weights, streams, targets)

    def gather(self, x: jax.Array) -> jax.Array:
        """`x` whole on every device of the mesh (itself without a mesh)."""
        return x if self.mesh is None else self._gather(x)

    def compile_buckets(self, scoring: bool = True, on_done: Callable[[], None] | None = None) -> None:
        """Build every bucket's step and, with `scoring`, each prefill bucket's prompt scoring,
        those not built yet: read back from the program cache, else traced one after another and
        compiled on threads as they come. Steps and prompt scoring of those shapes then run these
        executables. `on_done()` after each program."""
        steps = {}
        for rank_rows, s in self.buckets.all:
            key = (rank_rows * self.dp, s)
            if key not in self._steps:
                args = (self.weights, self.cache, *self._put(self.padding_step(key)))
                steps[key] = (describe("step", args, **self._program_settings),
                              functools.partial(self._step.lower, *args))
        self._steps.update(self.programs.compile(steps, self._naming_the_step, on_done))
        self._compile_snapshot_programs(on_done)
        if self.mtp_drafts:
            drafters = {}
            for key, step in self._steps.items():
                if key not in self._drafters:
                    seqs = self._put(self.padding_step(key)[1])
                    args = (self.weights, self.cache, step.out_info[1], *self._put((np.zeros(key, np.int32),)),
                            seqs, *self._put((np.zeros(key[0], np.int32),)))
                    drafters[key] = (describe("mtp drafts", args, **self._program_settings),
                                     functools.partial(self._draft.lower, *args))
            self._drafters.update(self.programs.compile(drafters, self._naming_the_step, on_done))
        if not scoring:
            return
        scorers = {}
        for key, step in self._steps.items():
            if key[1] > 1 and key not in self._scorers:
                args = (self.weights, step.out_info[1], np.zeros(key, np.int32))  # streams as the step lays them out
                scorers[key] = (describe("prompt scores", args, **self._program_settings),
                                functools.partial(self._head_scores.lower, *args))
        self._scorers.update(self.programs.compile(scorers, self._naming_the_step, on_done))

    def _naming_the_step(self, key: tuple[int, int]):
        return self._naming_the_backend((key[0] // self.dp, key[1]))

    def program_memory(self, scoring: bool = True) -> dict[tuple[int, int], BucketMemory]:
        """Per bucket (a rank's rows, S), what its step and, for prefill buckets with `scoring`,
        its prompt scoring need on a device besides the weights and the cache: from the
        executables `compile_buckets` built (for this runner's cache, or its shapes), never run.
        After warm-up this compiles nothing."""
        self.compile_buckets(scoring)
        out = {}
        for rank_rows, s in self.buckets.all:
            key = (rank_rows * self.dp, s)
            step = self._steps[key]
            scores = ProgramMemory.of(self._scorers[key]) if s > 1 and scoring else None
            out[(rank_rows, s)] = BucketMemory(ProgramMemory.of(step), scores, step.out_info[0])
        return out

    @property
    def num_programs(self) -> int:
        """Programs `compile_buckets` compiles: each bucket's step, each prefill bucket's scoring,
        and the two snapshot copies with prefix caching."""
        return (len(self.buckets.all) * (1 + self.mtp_drafts) + sum(1 for _, s in self.buckets.all if s > 1)
                + 2 * bool(self.num_prefix_snapshots))

    def warmup(self, on_compiled: Callable[[], None] | None = None) -> int:
        """Build every bucket's programs (`compile_buckets`; `on_compiled()` after each), then,
        where any had to be compiled, run a step of padding rows in each (it changes nothing) and
        score its streams: a kernel that compiles but fails to run fails here, and the cache's
        donation is checked. Programs all read back from the program cache ran like that when they
        were built, and nothing runs. Returns the number of compiles it took."""
        self.compiles.reset()
        self._touch_interpreter()
        self.warmup_logits: dict[int, jax.Array] = {}  # step rows -> logits laid out as steps give them
        self.warmup_drafts: dict[int, jax.Array] = {}  # step rows -> MTP drafts as the drafter gives them
        buckets = self.buckets.all
        t0, built = time.perf_counter(), self.programs.built
        self.compile_buckets(on_done=on_compiled)
        logger.info("warm-up: %d buckets' steps and prompt scoring built in %.1fs (%d compiles at once, %d "
                    "programs read back)", len(buckets), time.perf_counter() - t0,
                    min(len(buckets), compile_threads()), self.num_programs - (self.programs.built - built))
        if self.programs.built == built:
            for key, step in self._steps.items():  # the sampler warms up on logits placed as steps place them
                logits = step.out_info[0]
                self.warmup_logits[logits.shape[0]] = jax.device_put(np.zeros(logits.shape, logits.dtype),
                                                                     logits.sharding)
            for key, drafter in self._drafters.items():
                drafts = drafter.out_info[0]
                self.warmup_drafts[key[0]] = jax.device_put(np.zeros(drafts.shape, drafts.dtype), drafts.sharding)
        for rank_rows, s in buckets if self.programs.built > built else ():
            b = rank_rows * self.dp
            before = jax.tree.leaves(self.cache)[0]
            with self._naming_the_backend((rank_rows, s)):
                logits, streams = self._run_padding_step((b, s))
                if self.mtp_drafts:  # the drafter of padding rows writes nothing either
                    self.warmup_drafts[b] = jax.block_until_ready(self.draft(
                        streams, self.padding_step((b, s))[1], np.zeros((b, s), np.int32), np.zeros(b, np.int32)))
            self.warmup_logits[logits.shape[0]] = logits  # as steps lay them out: the sampler warms up on these
            if s > 1:  # prompt logprobs come from prefill steps
                jax.block_until_ready(self.prompt_scores(streams, np.zeros((b, s), np.int32)))
            if not before.is_deleted():
                raise RuntimeError("the KV cache was not donated to the step: every step would copy it")
        if self.num_prefix_snapshots and self.programs.built > built:  # copies of padding entries: nothing changes
            self.take_snapshots([])
            self.restore_snapshots([])
            jax.block_until_ready((self.cache, self.snapshots))
        self.programs.keep()  # every program built here ran: a restart may read them back without running them
        self.warm = True
        compiled = self.compiles.compiles
        self.compiles.reset()  # from here on, `compiles.compiles` counts what steps compile: 0
        return compiled

    @contextlib.contextmanager
    def _naming_the_backend(self, bucket: tuple[int, int]):
        """A step that fails to build or run on a Pallas backend (its first compile, at start-up)
        says so and names the way around it: the kernels are lowered for each GPU kind in CI but
        compiled only on the device itself, where a kernel can still fail (shared memory, registers)."""
        try:
            yield
        except Exception as err:
            if self.backend.name == XLA:
                raise
            device = jax.devices()[0].device_kind
            raise RuntimeError(
                f"the step of bucket {bucket[0]} x {bucket[1]} failed to build or run on {device} with the "
                f"{self.backend.name} attention backend (Pallas kernels). If the error comes from a kernel, "
                "--attention-backend xla (LLM(attention_backend=\"xla\")) serves the same model with XLA's "
                f"attention. The error: {type(err).__name__}: {err}"
            ) from err

    def _touch_interpreter(self) -> None:
        """Interpret-mode Pallas changes JAX's trace context the first time its interpreter is
        imported, which would make the second call of a step recompile: run one kernel first."""
        if self.backend.name == XLA or jax.default_backend() != "cpu":
            return
        lay = self.layout
        pool = kv_planes(lay.kv_cache_dtype, (1, 16), lay.head_dim, lay.rope_dim)
        rows = jnp.zeros((16, lay.head_dim), jnp.float32)
        jax.block_until_ready(self.backend.write_kv(pool, rows, jnp.arange(16, dtype=jnp.int32)))
