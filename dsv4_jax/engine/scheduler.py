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

Data parallelism: each rank has its own allocators, queues and step; a request is pinned at `add`
to the rank with the fewest unfinished requests. Plain Python: no jax here.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import math
import time
from typing import Any, Callable

from dsv4_jax.engine.block_manager import BlockManager
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

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", self.max_prefill_rows * self.max_prefill_tokens)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(
                f"SchedulerConfig.enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}"
            )
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "enable_chunked_prefill":
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
    """One row of a step: `token_ids` = request.all_token_ids[start : start + n]."""

    request: Request
    slot: int
    start: int
    token_ids: tuple[int, ...]
    compressed_blocks: array.array  # a copy of the request's blocks, covering positions [0, start + n)
    is_sampling: bool  # the chunk reaches the end of the known tokens: the engine samples this row

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

    @property
    def full(self) -> bool:
        return len(self.chunks) >= self.max_rows or self.budget_left <= 0

    def add(self, request: Request, n: int) -> None:
        self.chunks[request.request_id] = (request, n)
        self.budget_left -= n

    def drop(self, request: Request) -> None:
        if request.request_id in self.chunks:
            self.budget_left += self.chunks.pop(request.request_id)[1]

    def rows(self) -> list[ScheduledRow]:
        rows = []
        for request, n in self.chunks.values():
            start = request.num_computed_tokens
            tokens = tuple(request.token_ids(start, start + n))
            # blocks[:] is a memcpy of C ints: the row keeps this step's blocks whatever the request
            # holds later (a tuple of Python ints cost 1.6 ms a decode step at 32 rows x 4096 blocks).
            rows.append(ScheduledRow(request, request.slot, start, tokens, request.compressed_blocks[:],
                                     start + n == request.num_tokens))
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
        """Queue a new request on the least loaded rank; refuse one that could never run."""
        self.check(request)
        loads = [len(self._running[k]) + len(self._waiting[k]) for k in range(self.config.dp_size)]
        request.dp_rank = loads.index(min(loads))
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
            rows += plan.rows()
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
            self._add_decodes(rank, plan, decodes, preempted)
            self._add_prefills(rank, plan, preempted)
        else:
            plan = _StepPlan(c.max_prefill_rows, c.max_num_batched_tokens)
            self._add_prefills(rank, plan, preempted)
            self._add_decodes(rank, plan, decodes, preempted)
        return plan

    def _add_decodes(self, rank: int, plan: _StepPlan, decodes: list[Request], preempted: list[str]) -> None:
        for request in decodes:
            if plan.full:
                return
            if request.status is RequestStatus.RUNNING:  # not preempted by an earlier row
                self._add_running(rank, plan, request, 1, preempted)

    def _add_prefills(self, rank: int, plan: _StepPlan, preempted: list[str]) -> None:
        c, running, waiting = self.config, self._running[rank], self._waiting[rank]
        for request in [r for r in running if r.num_tokens - r.num_computed_tokens > 1
                        and r.num_output_tokens < r.max_tokens]:
            if plan.full:
                return
            if request.status is RequestStatus.RUNNING:
                n = min(request.num_tokens - request.num_computed_tokens, c.max_prefill_tokens, plan.budget_left)
                self._add_running(rank, plan, request, n, preempted)
        bm = self.block_managers[rank]
        promised = self._promised_blocks(rank)
        while waiting and not plan.full and len(running) < c.max_num_seqs and bm.num_free_slots:
            request = waiting[0]
            if request.num_output_tokens >= request.max_tokens:  # preempted with its last token pending
                return
            n = min(request.num_tokens, c.max_prefill_tokens, plan.budget_left)
            unsplit_prompt = not c.enable_chunked_prefill and not request.output_token_ids
            # Admitted when the blocks of all it has to compute (its prompt; after a preemption, its
            # prompt and output) are free beside those promised: on its first chunk's blocks alone, a
            # long prompt admitted into a nearly full pool preempted itself at its next chunk, and
            # was admitted again, step after step (its prefill redone, the queue behind it starved).
            whole = bm.blocks_for(request.num_tokens)
            if (unsplit_prompt and n < request.num_tokens) or whole > bm.num_free_blocks - promised \
                    or not bm.allocate_blocks(request, n):
                return  # first come, first served: the head waits for room
            promised += whole - len(request.compressed_blocks)
            waiting.popleft()
            bm.allocate_slot(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:  # not again after a preemption (vLLM's queue time)
                request.first_scheduled_time = time.monotonic()
            running.append(request)
            plan.add(request, n)

    def _promised_blocks(self, rank: int) -> int:
        """Blocks the rank's running prefills will still take for the rest of what they compute."""
        bm = self.block_managers[rank]
        return sum(bm.blocks_for(r.num_tokens) - len(r.compressed_blocks)
                   for r in self._running[rank] if r.num_tokens - r.num_computed_tokens > 1)

    def _head_fits(self, rank: int) -> bool:
        """The head of the rank's queue could be admitted now (`_add_prefills`' rule): otherwise a
        step waiting for it would only take rows from the decodes."""
        bm = self.block_managers[rank]
        return bm.blocks_for(self._waiting[rank][0].num_tokens) <= bm.num_free_blocks - self._promised_blocks(rank)

    def _add_running(self, rank: int, plan: _StepPlan, request: Request, n: int, preempted: list[str]) -> None:
        """Add a chunk of a running request, preempting the newest running requests (maybe this
        one) until its blocks fit."""
        bm, running = self.block_managers[rank], self._running[rank]
        while not bm.allocate_blocks(request, request.num_computed_tokens + n):
            victim = running.pop()
            plan.drop(victim)
            bm.free(victim)
            victim.status, victim.num_computed_tokens = RequestStatus.WAITING, 0
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self._waiting[rank].appendleft(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return
        plan.add(request, n)

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
                request.num_computed_tokens += len(row.token_ids)
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
                    self.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
        return got
