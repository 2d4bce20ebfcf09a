"""The scheduler: which chunks of which requests run in the next runner step.

Each step, per data-parallel rank, is one group of rows for `ModelRunner.step`: a row is a chunk
of one sequence (a prefill chunk, or the single token of a decode). `ScheduledRow` has the
fields the runner reads from a `StepRow` (slot, start, token_ids, compressed_blocks), so rows go
to the runner as they are.

Policy, per rank:
* A step whose rows all hold one token runs in a decode bucket (up to `max_decode_rows` rows;
  the runner pads more to a prefill bucket);
  a step with any longer chunk runs in a prefill bucket (up to `max_prefill_rows` rows of at
  most `max_prefill_tokens` tokens), decode tokens riding in it as rows of one token. Every step
  holds at most `max_num_batched_tokens` real tokens.
* With nothing to prefill the step is decode-only. Otherwise, when the running decodes leave room
  for a prefill row, the step is mixed: every decode first, then prefill chunks (running partial
  prefills in admission order, then waiting requests first come, first served).
* When the decodes alone would fill a prefill step, steps alternate: a decode-only step, then a
  prefill-first step (prefill chunks first, decodes in the rows left). So neither side starves:
  each progresses at least every other step. When decodes outnumber a step's rows, the least
  recently served go first.
* Every block a row writes (positions up to start + n - 1) is allocated before the step. When
  blocks run out for a running request, the newest running request is preempted by recompute:
  its slot and blocks are freed and it goes back to the front of the waiting queue, to recompute
  its prompt and output so far. The oldest running request therefore always progresses (it fits
  alone, `add` makes sure of that). Admission never preempts: the head of the queue waits until
  the blocks of its whole prompt (and output, after a preemption) are free beside those the
  running prefills will still take, so an admitted prefill is not preempted by its own next
  chunk (only by the growth of older requests).
* With `enable_chunked_prefill=False` a prompt is never split (prompts longer than one row are
  refused); the recompute of a preempted request is still split, as it must be.
* `update` finishes a request that reached max_tokens ("length", checked before any stop
  condition, as vLLM does); the engine finishes it for a stop token or string with `finish`.
* Async scheduling: `schedule` may run once more before the last step's `update` (the device
  still computes it). It then takes that step as done: each row's chunk counts as computed and
  each sampling row's token is a PLACEHOLDER, which the next step reads on the device and
  `update` fills in later. A request whose placeholder brings it to max_tokens gets no new row;
  one that the engine stops at `update` loses the row already scheduled (its token is dropped).

Prefix caching (`num_prefix_snapshots` > 0; docs/prefix_caching.md): at admission a request
takes the cached blocks of its longest prefix that ends at a block boundary with a snapshot,
keeping at least its last token to compute, and starts computing there; its row names the
snapshot the engine restores into its slot first (`ScheduledRow.restore`). A row that ends at a
block boundary names a snapshot id the engine takes right after the step
(`ScheduledRow.snapshot`); prefill chunks end at the last block boundary they cross so that
there is one. `update`, when the tokens are known, registers each running request's full
blocks under their hashes and each snapshot whose block is cached.

Speculative decoding (`num_speculative_tokens` k > 0; engine/speculative.py): a decode row
carries the request's drafts after its token (`Request.draft_token_ids`, at most k, none past
max_tokens or max_model_len or the step's token budget), and its blocks cover the drafts'
positions. `update` counts the row's own token as computed and gives it the first sampled token;
`extend` then applies each accepted draft (computed) and the token after it, and
`release_rejected_blocks` gives back the blocks only rejected drafts needed. Scheduling is then
synchronous (the engine turns async scheduling off).

Data parallelism: each rank has its own allocators, queues and step; a request is pinned at `add`
to the rank holding its longest cached prefix, ties going to the rank with the fewest unfinished
requests, among the ranks with at most `max_num_seqs` more unfinished requests than the least
loaded (so one cached system prompt does not send every request to one rank: the others compute
it once and hold it too). Plain Python: no jax here.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import functools
import math
import time
from typing import Any, Callable

from dsv4_jax.engine.block_manager import BlockManager
from dsv4_jax.engine.prefix_cache import SnapshotPool, block_hasher, root_hash
from dsv4_jax.engine.request import PLACEHOLDER, Request, RequestRejected, RequestStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of a step and of the cache, per data-parallel rank (as vLLM's flags)."""

    max_num_seqs: int  # running requests per rank
    max_model_len: int  # prompt + max_tokens
    num_seq_slots: int  # the paged cache's sizes (PagedCacheLayout)
    num_compressed_blocks: int
    block_size: int
    max_blocks_per_seq: int
    max_prefill_rows: int = 8  # the largest prefill bucket (StepBuckets.prefill)
    max_prefill_tokens: int = 256
    max_decode_rows: int = 32  # the largest decode bucket
    max_num_batched_tokens: int | None = None  # per step; None: max_prefill_rows * max_prefill_tokens
    enable_chunked_prefill: bool = True
    dp_size: int = 1
    num_prefix_snapshots: int = 0  # per rank; 0: prefix caching off
    prefix_caching_hash_algo: str = "sha256"
    cache_identity: str = ""  # what changes the KV besides the tokens (model, dtypes): the hash chain's root
    num_speculative_tokens: int = 0  # drafts a decode row may carry; 0: speculative decoding off

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", self.max_prefill_rows * self.max_prefill_tokens)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(
                f"SchedulerConfig.enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}"
            )
        block_hasher(self.prefix_caching_hash_algo)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("enable_chunked_prefill", "prefix_caching_hash_algo", "cache_identity"):
                continue
            if field.name in ("num_prefix_snapshots", "num_speculative_tokens") and value == 0:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{field.name} must be an int >= 1, got {value!r}")

    @classmethod
    def for_runner(cls, buckets: Any, layout: Any, **options: Any) -> SchedulerConfig:
        """Limits read from a runner's `StepBuckets` and `PagedCacheLayout` (duck-typed, so this
        module imports no jax); `options` gives the rest (max_num_seqs, max_model_len, ...)."""
        rows, tokens = buckets.prefill[-1]  # StepBuckets sorts prefill buckets by size
        return cls(
            num_seq_slots=layout.num_seq_slots, num_compressed_blocks=layout.num_compressed_blocks,
            block_size=layout.block_size, max_blocks_per_seq=layout.max_blocks_per_seq,
            max_prefill_rows=rows, max_prefill_tokens=tokens, max_decode_rows=max(buckets.decode), **options,
        )


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """One row of a step: `token_ids` = request.all_token_ids[start : start + n], then the
    row's `num_drafts` drafts (speculative decoding)."""

    request: Request
    slot: int
    start: int
    token_ids: tuple[int, ...]
    compressed_blocks: array.array  # a copy of the request's blocks, covering positions [0, start + n)
    is_sampling: bool  # the chunk reaches the end of the known tokens: the engine samples this row
    restore: int = -1  # a prefix-cache hit: the snapshot to copy into the slot before the step (state at `start`)
    snapshot: int = -1  # the snapshot id to take after the step (the chunk ends at a block boundary)
    num_drafts: int = 0  # drafts after the known tokens (a verify row)

    @property
    def num_known(self) -> int:
        """Tokens of the row that are the request's own (the rest are drafts, not known to be right)."""
        return len(self.token_ids) - self.num_drafts

    @property
    def drafts(self) -> tuple[int, ...]:
        return tuple(self.token_ids[self.num_known :])

    @property
    def end(self) -> int:
        """The position after the row's last known token."""
        return self.start + self.num_known

    @property
    def dp_rank(self) -> int:
        return self.request.dp_rank


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    rows: tuple[ScheduledRow, ...]  # every rank's rows
    preempted: tuple[str, ...]  # request ids preempted while building this step

    def rows_of(self, rank: int) -> tuple[ScheduledRow, ...]:
        """The rows of one data-parallel rank's step."""
        return tuple(row for row in self.rows if row.dp_rank == rank)


class _StepPlan:
    """The rows of one rank's step while it is built: request id -> (request, chunk length)."""

    def __init__(self, max_rows: int, budget: int):
        self.max_rows, self.budget_left = max_rows, budget
        self.chunks: dict[str, tuple[Request, int]] = {}
        self.restores: dict[str, int] = {}  # request id -> snapshot restored before its chunk

    @property
    def full(self) -> bool:
        return len(self.chunks) >= self.max_rows or self.budget_left <= 0

    def add(self, request: Request, n: int) -> None:
        self.chunks[request.request_id] = (request, n)
        self.budget_left -= n

    def drop(self, request: Request) -> None:
        self.restores.pop(request.request_id, None)
        if request.request_id in self.chunks:
            self.budget_left += self.chunks.pop(request.request_id)[1]

    def rows(self, snapshot_for: Callable[[Request, int], int]) -> list[ScheduledRow]:
        """The step's rows; `snapshot_for(request, end)` gives the snapshot id a row ending at
        `end` takes (-1: none)."""
        rows = []
        for request, n in self.chunks.values():
            start = request.num_computed_tokens
            known = min(n, request.num_tokens - start)
            drafts = tuple(request.draft_token_ids[: n - known])
            tokens = tuple(request.token_ids(start, start + known)) + drafts
            # blocks[:] is a memcpy of C ints: the row keeps this step's blocks whatever the request
            # holds later (a tuple of Python ints cost 1.6 ms a decode step at 32 rows x 4096 blocks).
            rows.append(ScheduledRow(request, request.slot, start, tokens, request.compressed_blocks[:],
                                     start + known == request.num_tokens, self.restores.get(request.request_id, -1),
                                     snapshot_for(request, start + known), len(drafts)))
        return rows


class Scheduler:
    """Queues, allocators and step building of every data-parallel rank (policy: module doc)."""

    def __init__(self, config: SchedulerConfig, block_manager_factory: Callable[..., BlockManager] = BlockManager):
        """`block_manager_factory(num_seq_slots, num_compressed_blocks, block_size, max_blocks_per_seq)`
        makes each rank's allocators (tests give one that hands out fewer blocks than the pools hold)."""
        self.config = config
        c = config
        self.block_managers = tuple(
            block_manager_factory(c.num_seq_slots, c.num_compressed_blocks, c.block_size, c.max_blocks_per_seq)
            for _ in range(c.dp_size)
        )
        self._waiting = [collections.deque() for _ in range(c.dp_size)]  # preempted ones at the front
        self._running: list[list[Request]] = [[] for _ in range(c.dp_size)]  # in admission order
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._last_served: dict[str, int] = {}  # request id -> step it last had a row in
        self._decode_turn = [False] * c.dp_size  # alternation when decodes fill a prefill step
        # Scheduled, not yet updated: at most two (async scheduling), oldest first; the ids of
        # those already taken as done by a later schedule().
        self._pending: collections.deque[SchedulerOutput] = collections.deque()
        self._taken_as_done: set[int] = set()
        self._step = 0
        self.num_preemptions = 0  # vllm:num_preemptions_total
        # Prefix caching: each rank's snapshot ids, the block hash function and the chain's root.
        self.prefix_caching = c.num_prefix_snapshots > 0
        self.snapshot_pools = tuple(SnapshotPool(c.num_prefix_snapshots) for _ in range(c.dp_size)) \
            if self.prefix_caching else ()
        for bm, pool in zip(self.block_managers, self.snapshot_pools):
            bm.on_evict = pool.drop
        self._hash = block_hasher(c.prefix_caching_hash_algo)
        self._root = root_hash(self._hash, c.cache_identity)
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission (vllm:prefix_cache_queries)
        self.prefix_cache_hits = 0  # of them, tokens found cached (vllm:prefix_cache_hits)

    # ---- metrics ----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return sum(len(r) for r in self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(w) for w in self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of usable compressed blocks in use over all ranks (vllm:kv_cache_usage_perc)."""
        return sum(bm.usage for bm in self.block_managers) / len(self.block_managers)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- requests in and out ----------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a new request on the rank holding its longest cached prefix, else (and on ties)
        the least loaded one (module doc); refuse one that could never run."""
        self.check(request)
        ranks = range(self.config.dp_size)
        loads = [len(self._running[k]) + len(self._waiting[k]) for k in ranks]
        hits = [self._prefix_hit(k, request)[0] for k in ranks] if self.prefix_caching else [0] * len(loads)
        near = [k for k in ranks if loads[k] <= min(loads) + self.config.max_num_seqs]
        request.dp_rank = min(near, key=lambda k: (-hits[k], loads[k]))
        self._waiting[request.dp_rank].append(request)
        self._requests[request.request_id] = request
        self._last_served[request.request_id] = -1

    def check(self, request: Request) -> None:
        """Raise (RequestRejected, naming the field) for a request `add` would refuse."""
        c, rid = self.config, request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already queued or running")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {rid}: add() takes a new request, got status {request.status.value} with "
                             f"{request.num_computed_tokens} computed and {request.num_output_tokens} output tokens")
        prompt = len(request.prompt_token_ids)
        if prompt == 0:
            raise RequestRejected(f"request {rid}: the prompt is empty (at least 1 token is needed)", "prompt")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise RequestRejected(f"request {rid}: max_tokens must be an int >= 1, got {request.max_tokens!r}",
                                  "max_tokens")
        total = prompt + request.max_tokens
        if total > c.max_model_len:
            raise RequestRejected(f"request {rid}: prompt {prompt} + max_tokens {request.max_tokens} = {total} "
                                  f"tokens exceed max_model_len={c.max_model_len}", "max_tokens")
        # The last sampled token is never fed back: the KV covers at most total - 1 positions.
        blocks = math.ceil((total - 1) / c.block_size)
        usable = self.block_managers[0].num_compressed_blocks  # what the allocator hands out
        if blocks > min(usable, c.max_blocks_per_seq):
            raise RequestRejected(f"request {rid}: {total - 1} cached positions need {blocks} compressed blocks "
                                  f"of {c.block_size}, more than the {usable} usable blocks of the pool or "
                                  f"max_blocks_per_seq={c.max_blocks_per_seq}", "max_tokens")
        if not c.enable_chunked_prefill and prompt > min(c.max_prefill_tokens, c.max_num_batched_tokens):
            raise RequestRejected(f"request {rid}: prompt {prompt} is longer than one prefill row "
                                  f"(max_prefill_tokens={c.max_prefill_tokens}, max_num_batched_tokens="
                                  f"{c.max_num_batched_tokens}) and enable_chunked_prefill is off", "prompt")

    def finish(self, request_id: str, status: RequestStatus) -> bool:
        """End a request (stop, length, abort) and free what it holds, at any moment. False when
        it is not queued or running (already finished, or unknown)."""
        if not status.finished:
            raise ValueError(f"finish() takes a finished status, got {status.value!r}")
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        rank = request.dp_rank
        if request.status is RequestStatus.RUNNING:
            self._running[rank].remove(request)
        else:
            self._waiting[rank].remove(request)
        self.block_managers[rank].free(request)
        del self._last_served[request_id]
        request.status = status
        return True

    def abort(self, request_id: str) -> bool:
        """Abort a request; its rows in a step already scheduled are ignored by `update`."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def drop_pending(self) -> None:
        """Forget the steps scheduled and not updated, after a step failed part-way (an exception,
        Ctrl-C in a notebook). Only with no unfinished request: their counts and outputs would
        depend on the steps forgotten."""
        if self._requests:
            raise ValueError(f"drop_pending() with {len(self._requests)} unfinished requests: abort them first")
        for output in self._pending:
            self._release_snapshots(output.rows)
        self._pending.clear()
        self._taken_as_done.clear()

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The rows of the next runner step, every rank's. With one step not yet updated, it is
        taken as done (async scheduling, module doc); with two, this is an error."""
        if len(self._pending) > 1:
            raise RuntimeError("schedule() called with two steps not updated: update() the oldest first")
        if self._pending and id(self._pending[0]) not in self._taken_as_done:
            self._take_as_done(self._pending[0])
        rows: list[ScheduledRow] = []
        preempted: list[str] = []
        kinds = [self._step_kind(rank) for rank in range(self.config.dp_size)]
        # One step, one bucket: when any rank prefills, every rank's rows must fit a prefill bucket.
        decode_rows = self.config.max_prefill_rows if any(k != "decode" for k in kinds) else None
        for rank, kind in enumerate(kinds):
            plan = self._plan_rank(rank, kind, preempted, decode_rows)
            for request_id in plan.chunks:
                self._last_served[request_id] = self._step
            rows += plan.rows(functools.partial(self._snapshot_for, rank))
        self._step += 1
        output = SchedulerOutput(tuple(rows), tuple(preempted))
        if rows:
            self._pending.append(output)
        return output

    def _take_as_done(self, output: SchedulerOutput) -> None:
        self._taken_as_done.add(id(output))
        for row in output.rows:
            request = row.request
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens += len(row.token_ids)
                if row.is_sampling:
                    request.output_token_ids.append(PLACEHOLDER)

    def _running_decodes(self, rank: int) -> tuple[list[Request], list[Request]]:
        """(running requests that get rows, those of them with one token to compute)."""
        # A request whose pending token is its last (max_tokens) is finished by update, not run.
        running = [r for r in self._running[rank] if r.num_output_tokens < r.max_tokens]
        decodes = sorted((r for r in running if r.num_tokens - r.num_computed_tokens == 1),
                         key=lambda r: self._last_served[r.request_id])  # stable: admission order on ties
        return running, decodes

    def _step_kind(self, rank: int) -> str:
        """"decode" (decode rows only), "mixed" (every decode, then prefill chunks) or
        "prefill_first" (prefill chunks, then decodes in the rows left) for this rank's step."""
        c = self.config
        running, decodes = self._running_decodes(rank)
        partial = any(r.num_tokens - r.num_computed_tokens > 1 for r in running)
        admissible = (bool(self._waiting[rank]) and len(running) < c.max_num_seqs
                      and self.block_managers[rank].num_free_slots > 0 and self._head_fits(rank))
        if not (partial or admissible):
            return "decode"
        if len(decodes) < min(c.max_prefill_rows, c.max_num_batched_tokens):  # room for every decode and a prefill row
            return "mixed"
        self._decode_turn[rank] = not self._decode_turn[rank]
        return "decode" if self._decode_turn[rank] else "prefill_first"

    def _plan_rank(self, rank: int, kind: str, preempted: list[str], decode_rows: int | None) -> _StepPlan:
        """The rank's rows for a step of `kind`; a decode step holds at most `decode_rows` rows
        when given (another rank prefills in the same step)."""
        c = self.config
        _, decodes = self._running_decodes(rank)
        if kind == "decode":
            plan = _StepPlan(decode_rows or c.max_decode_rows, c.max_num_batched_tokens)
            self._add_decodes(rank, plan, decodes, preempted)
        elif kind == "mixed":
            plan = _StepPlan(c.max_prefill_rows, c.max_num_batched_tokens)
            self._add_decodes(rank, plan, decodes, preempted, prefill_row=True)
            self._add_prefills(rank, plan, preempted)
        else:
            plan = _StepPlan(c.max_prefill_rows, c.max_num_batched_tokens)
            # The decodes come after the prefills here: an admission must leave them the blocks
            # they grow into, or their rows would preempt the request just admitted.
            bm = self.block_managers[rank]
            k = c.num_speculative_tokens
            growth = sum(max(0, bm.blocks_for(r.num_computed_tokens + 1 + min(len(r.draft_token_ids), k))
                                - len(r.compressed_blocks)) for r in decodes)
            self._add_prefills(rank, plan, preempted, reserved=growth)
            self._add_decodes(rank, plan, decodes, preempted)
        return plan

    def _add_decodes(self, rank: int, plan: _StepPlan, decodes: list[Request], preempted: list[str],
                     prefill_row: bool = False) -> None:
        """Decode rows, each with its drafts; `prefill_row`: a prefill row follows (a mixed step)."""
        for i, request in enumerate(decodes):
            if plan.full:
                return
            if request.status is RequestStatus.RUNNING:  # not preempted by an earlier row
                # Each later row (and the prefill row) keeps a token of the budget: drafts never
                # take a row from another request.
                later = min(len(decodes) - i - 1, plan.max_rows - len(plan.chunks) - 1) + prefill_row
                self._add_running(rank, plan, request, 1 + self._num_drafts(rank, request, plan, later), preempted)

    def _num_drafts(self, rank: int, request: Request, plan: _StepPlan, reserved: int) -> int:
        """Drafts a decode row of `request` carries: its proposals, at most k, none that could
        only follow its last token (max_tokens) or pass max_model_len, within the step's budget
        less `reserved` tokens, and only in blocks already free (drafts never preempt). With
        prefix caching, none past the next block boundary: a boundary is then always some row's
        known end, where its snapshot is taken."""
        c = self.config
        if not c.num_speculative_tokens or not request.draft_token_ids:
            return 0
        drafts = min(len(request.draft_token_ids), c.num_speculative_tokens,
                     request.max_tokens - request.num_output_tokens - 1,
                     c.max_model_len - request.num_tokens, plan.budget_left - 1 - reserved)
        if self.prefix_caching:
            end = request.num_tokens  # the row's known end
            drafts = min(drafts, (end // c.block_size + 1) * c.block_size - end - 1)
        bm = self.block_managers[rank]
        while drafts > 0 and bm.blocks_for(request.num_tokens + drafts) - len(request.compressed_blocks) > bm.num_free_blocks:
            drafts -= 1
        return max(drafts, 0)

    def _add_prefills(self, rank: int, plan: _StepPlan, preempted: list[str], reserved: int = 0) -> None:
        """Running prefills' next chunks, then admissions first come, first served; `reserved`
        blocks are kept free for rows added after these."""
        c, running, waiting = self.config, self._running[rank], self._waiting[rank]
        for request in [r for r in running if r.num_tokens - r.num_computed_tokens > 1
                        and r.num_output_tokens < r.max_tokens]:
            if plan.full:
                return
            if request.status is RequestStatus.RUNNING:
                n = min(request.num_tokens - request.num_computed_tokens, c.max_prefill_tokens, plan.budget_left)
                self._add_running(rank, plan, request, self._chunk(request, request.num_computed_tokens, n),
                                  preempted)
        bm = self.block_managers[rank]
        promised = self._promised_blocks(rank) + reserved
        while waiting and not plan.full and len(running) < c.max_num_seqs and bm.num_free_slots:
            request = waiting[0]
            if request.num_output_tokens >= request.max_tokens:  # preempted with its last token pending
                return
            cached, in_cache = self._prefix_hit(rank, request) if self.prefix_caching else (0, 0)
            start = cached * c.block_size
            n = min(request.num_tokens - start, c.max_prefill_tokens, plan.budget_left)
            if in_cache > cached and (c.enable_chunked_prefill or request.output_token_ids):
                # Cached blocks past the deepest snapshot: the chunk ends where they end, and the
                # snapshot taken there lets later requests hit all of them.
                n = min(n, in_cache * c.block_size - start)
            n = self._chunk(request, start, n)
            unsplit_prompt = not c.enable_chunked_prefill and not request.output_token_ids
            # Admitted when the blocks of all it has to compute (its prompt; after a preemption, its
            # prompt and output) are free beside those promised: on its first chunk's blocks alone, a
            # long prompt admitted into a nearly full pool preempted itself at its next chunk, and
            # was admitted again, step after step (its prefill redone, the queue behind it starved).
            whole = bm.blocks_for(request.num_tokens)
            if (unsplit_prompt and start + n < request.num_tokens) \
                    or self._blocks_to_admit(rank, request, cached) > bm.num_free_blocks - promised:
                return  # first come, first served: the head waits for room
            self._count_hit(request, start)
            bm.share(request, request.block_hashes[:cached])
            if not bm.allocate_blocks(request, start + n):  # cannot fail: checked above
                raise RuntimeError(f"request {request.request_id}: blocks counted free were not")
            request.num_computed_tokens, request.num_registered_blocks = start, cached
            if cached:
                plan.restores[request.request_id] = self.snapshot_pools[rank].lookup(request.block_hashes[cached - 1])
            promised += whole - len(request.compressed_blocks)
            waiting.popleft()
            bm.allocate_slot(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:  # not again after a preemption (vLLM's queue time)
                request.first_scheduled_time = time.monotonic()
            running.append(request)
            plan.add(request, n)

    # ---- prefix caching ---------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """The chained hashes of `request`'s full blocks within its first `num_tokens` tokens,
        as far as its tokens are known (a pending sample is not), extended in place."""
        hashes, bs = request.block_hashes, self.config.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            k = len(hashes)
            ids = request.token_ids(k * bs, (k + 1) * bs)
            if PLACEHOLDER in ids:
                break
            hashes.append(self._hash(hashes[-1] if hashes else self._root, ids))
        return hashes

    def _prefix_hit(self, rank: int, request: Request) -> tuple[int, int]:
        """(k, m): the deepest block boundary k * block_size, before the request's last token,
        whose blocks are all cached on `rank` and whose state has a snapshot (0: no hit), and how
        many leading blocks are cached (m >= k). Nothing is touched."""
        if request.skip_prefix_cache:
            return 0, 0
        hashes = self._block_hashes(request, request.num_tokens - 1)
        pool = self.snapshot_pools[rank]
        cached = self.block_managers[rank].num_cached_prefix(hashes)
        for k in range(cached, 0, -1):
            if hashes[k - 1] in pool:
                return k, cached
        return 0, cached

    def _blocks_to_admit(self, rank: int, request: Request, cached: int) -> int:
        """Blocks that admitting `request` with `cached` shared blocks takes out of the free count:
        those of the rest of what it computes, and the shared ones nobody held."""
        bm = self.block_managers[rank]
        return bm.blocks_for(request.num_tokens) - cached + bm.num_evictable_in(request.block_hashes[:cached])

    def _count_hit(self, request: Request, cached_tokens: int) -> None:
        """A request's first admission, as vLLM counts it: not again after a preemption, and not
        at all for a request that skips the cache."""
        if request.num_cached_tokens is not None:
            return
        request.num_cached_tokens = cached_tokens
        if self.prefix_caching and not request.skip_prefix_cache:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += cached_tokens

    def _chunk(self, request: Request, start: int, n: int) -> int:
        """A prefill chunk of up to `n` tokens from `start`: with prefix caching, one that crosses
        a block boundary ends at the last it crosses, where a snapshot is taken (the state of a
        boundary inside a chunk is never kept)."""
        c = self.config
        if not self.prefix_caching or (not c.enable_chunked_prefill and not request.output_token_ids):
            return n
        boundary = (start + n) // c.block_size * c.block_size
        return boundary - start if boundary > start else n

    def _snapshot_for(self, rank: int, request: Request, end: int) -> int:
        """The snapshot id a row of `request` ending at `end` takes: a new one at a block boundary
        whose block has none yet, else -1."""
        bs = self.config.block_size
        if not self.prefix_caching or end % bs:
            return -1
        hashes = self._block_hashes(request, end)
        if len(hashes) >= end // bs and hashes[end // bs - 1] in self.snapshot_pools[rank]:
            return -1
        snap = self.snapshot_pools[rank].reserve()
        return -1 if snap is None else snap

    def _register(self, row: ScheduledRow) -> None:
        """After a row's step: cache its request's full computed blocks, and its snapshot where
        the block ending at the row's end is cached (otherwise the snapshot goes back)."""
        request, rank = row.request, row.dp_rank
        bm = self.block_managers[rank]
        running = request.status is RequestStatus.RUNNING
        if running:
            self._register_blocks(request, rank)
        if row.snapshot < 0:
            return
        k = row.end // self.config.block_size
        hashes = request.block_hashes
        if running and len(hashes) >= k and bm.is_cached(hashes[k - 1]):
            self.snapshot_pools[rank].register(row.snapshot, hashes[k - 1])
        else:
            self.snapshot_pools[rank].release(row.snapshot)

    def _register_blocks(self, request: Request, rank: int) -> None:
        """Cache a running request's full computed blocks, only those completed since the last
        time (a long context is not walked again)."""
        hashes = self._block_hashes(request, request.num_computed_tokens)
        n, first = min(len(hashes), len(request.compressed_blocks)), request.num_registered_blocks
        if n > first:
            self.block_managers[rank].register(request, hashes[first:n], first)
            request.num_registered_blocks = n

    def _release_snapshots(self, rows) -> None:
        for row in rows:
            if row.snapshot >= 0:
                self.snapshot_pools[row.dp_rank].release(row.snapshot)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and snapshot; False (nothing changed) while any request is
        queued or running, as vLLM refuses it then."""
        if self._requests:
            return False
        for bm in self.block_managers:
            bm.reset_prefix_cache()
        for pool in self.snapshot_pools:
            pool.clear()
        return True

    def check_invariants(self) -> None:
        """Every rank's allocator and snapshot pool invariants (`BlockManager.check_invariants`)."""
        for bm in self.block_managers:
            bm.check_invariants()
        for pool in self.snapshot_pools:
            pool.check_invariants()

    def _promised_blocks(self, rank: int) -> int:
        """Blocks the rank's running prefills will still take for the rest of what they compute."""
        bm = self.block_managers[rank]
        return sum(bm.blocks_for(r.num_tokens) - len(r.compressed_blocks)
                   for r in self._running[rank] if r.num_tokens - r.num_computed_tokens > 1)

    def _head_fits(self, rank: int) -> bool:
        """The head of the rank's queue could be admitted now (`_add_prefills`' rule): otherwise a
        step waiting for it would only take rows from the decodes."""
        head = self._waiting[rank][0]
        cached = self._prefix_hit(rank, head)[0] if self.prefix_caching else 0
        return self._blocks_to_admit(rank, head, cached) <= self.block_managers[rank].num_free_blocks \
            - self._promised_blocks(rank)

    def _add_running(self, rank: int, plan: _StepPlan, request: Request, n: int, preempted: list[str]) -> None:
        """Add a chunk of a running request, preempting the newest running requests (maybe this
        one) until its blocks fit."""
        bm, running = self.block_managers[rank], self._running[rank]
        while not bm.allocate_blocks(request, request.num_computed_tokens + n):
            victim = running.pop()
            plan.drop(victim)
            bm.free(victim)
            victim.status, victim.num_computed_tokens, victim.num_registered_blocks = RequestStatus.WAITING, 0, 0
            victim.draft_token_ids = []
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self._waiting[rank].appendleft(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return
        plan.add(request, n)

    def extend(self, row: ScheduledRow, token: int) -> None:
        """Speculative decoding, after `update`: the row's next draft was accepted (its position
        is computed) and `token` follows it; a request that reaches max_tokens with it is
        finished ("length", as `update` finishes it)."""
        request = row.request
        request.num_computed_tokens += 1
        request.output_token_ids.append(int(token))
        request.last_token_time = time.monotonic()
        if self.prefix_caching:
            self._register_blocks(request, row.dp_rank)
        if request.num_output_tokens >= request.max_tokens:
            self.finish(request.request_id, RequestStatus.FINISHED_LENGTH)

    def release_rejected_blocks(self, request: Request) -> None:
        """Give back the blocks a running request's verify row took past its computed positions
        (for drafts that were rejected): it holds the blocks of what it wrote, as without drafts."""
        if request.status is RequestStatus.RUNNING and request.compressed_blocks:
            self.block_managers[request.dp_rank].release_blocks_past(request, request.num_computed_tokens)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply a finished runner step (the oldest not updated): advance each row's request by its
        chunk and give each sampling row its token (`sampled`: request id -> token), or, for a step
        already taken as done, fill in its placeholders. Rows of requests finished or aborted since
        `schedule` are ignored. Returns the requests that got a token; those that reached
        max_tokens are finished ("length")."""
        if output.rows and (not self._pending or output is not self._pending[0]):
            raise ValueError("update() takes the oldest step not updated yet, once")
        taken = id(output) in self._taken_as_done
        # Taken as done: a request preempted since still gets its token (its outputs hold it).
        live = [row for row in output.rows if not row.request.status.finished
                and (taken or row.request.status is RequestStatus.RUNNING)]
        live_ids = {id(row) for row in live}
        missing = [row.request.request_id for row in live if row.is_sampling and row.request.request_id not in sampled]
        if missing:
            raise ValueError(f"no sampled token for the sampling rows of requests {missing}")
        if output.rows:
            self._pending.popleft()
            self._taken_as_done.discard(id(output))
        got, now = [], time.monotonic()
        for row in live:
            request = row.request
            if not taken:
                request.num_computed_tokens += row.num_known  # accepted drafts: `extend`
            if row.is_sampling:
                token = int(sampled[request.request_id])
                if taken:  # the placeholder sits right after the row's chunk
                    request.output_token_ids[row.start + len(row.token_ids) - len(request.prompt_token_ids)] = token
                else:
                    request.output_token_ids.append(token)
                if request.first_token_time is None:
                    request.first_token_time = now
                request.last_token_time = now
                got.append(request)
                if request.num_output_tokens >= request.max_tokens:
                    if self.prefix_caching:  # before its blocks go: a next turn may extend this output
                        self._register(row)
                    self.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
                    continue
            if self.prefix_caching:
                self._register(row)
        if self.prefix_caching:
            self._release_snapshots(row for row in output.rows if id(row) not in live_ids)
        return got
