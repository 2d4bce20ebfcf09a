"""Prefix caching in the host-only scheduler, against a simulated device.

`Device` stands in for the runner and the model: the fake model's token at each output position
is fixed by (request id, position), so every request's whole token sequence is known up front.
The simulated device keeps, per sequence slot, the token prefix whose state the slot holds, per
compressed block the token prefix whose entries the block holds, and per snapshot the prefix whose
state it holds; restores, writes and snapshots happen in the device's order (restore before the
step, snapshots after it). Every scheduled row is then checked against that model: the blocks it
reads (shared or its own) hold its own prefix, the snapshot it restores holds exactly its tokens
before `start`, and a row that continues without a restore finds its slot holding exactly that.
No expectation below is read from the scheduler's own tables."""

from __future__ import annotations

import math
import random
import zlib

import pytest

from dsv4_jax.engine.prefix_cache import HASH_ALGOS, block_hasher, root_hash
from dsv4_jax.engine.request import PLACEHOLDER, Request, RequestStatus
from dsv4_jax.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

VOCAB = 50_000
BS = 16


def model_token(request_id: str, position: int) -> int:
    """The fake model: the token sampled at `position` of `request_id` (never EOS)."""
    return zlib.crc32(f"{request_id}@{position}".encode()) % VOCAB


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def prefix_config(**overrides) -> SchedulerConfig:
    base = {"max_num_seqs": 6, "max_model_len": 256, "num_seq_slots": 8, "num_compressed_blocks": 64,
            "block_size": BS, "max_blocks_per_seq": 16, "max_prefill_rows": 4, "max_prefill_tokens": 16,
            "max_decode_rows": 8, "num_prefix_snapshots": 32}
    return SchedulerConfig(**{**base, **overrides})


class AdmittedThenPreempted(AssertionError):
    """A request admitted by a schedule() was preempted by the same schedule(), before any row."""


class Device:
    """The simulated runner and model of one scheduler (module doc); counts what the tests assert on."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        ranks = range(scheduler.config.dp_size)
        self.bs = scheduler.config.block_size
        self.truth: dict[str, tuple[int, ...]] = {}  # request id -> prompt + every output it may produce
        self.slots = [{} for _ in ranks]  # slot -> token prefix whose state it holds
        self.snapshots = [{} for _ in ranks]  # snapshot id -> token prefix whose state it holds
        self.blocks = [{} for _ in ranks]  # block id -> token prefix whose entries it holds (up to its last written)
        self.pending: tuple[SchedulerOutput, dict[str, int]] | None = None  # scheduled, not updated (async)
        self.requests: dict[str, Request] = {}
        self.admissions: list[tuple[str, int, int]] = []  # (request id, first row's start, tokens at admission)
        self.first_start: dict[str, int] = {}  # request id -> start of its first admission's row
        self.num_rows = self.num_restores = 0

    # ---- requests ----------------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], max_tokens: int, **fields) -> Request:
        prompt = list(prompt)
        outputs = [model_token(request_id, p) for p in range(len(prompt), len(prompt) + max_tokens)]
        self.truth[request_id] = tuple(prompt + outputs)
        request = Request(request_id, prompt, max_tokens, **fields)
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request

    def check_tokens(self, request: Request) -> None:
        """The request's known tokens are its true ones; only a pending sample is a placeholder."""
        truth = self.truth[request.request_id]
        tokens = request.all_token_ids
        assert len(tokens) <= len(truth)
        placeholders = [p for p, t in enumerate(tokens) if t == PLACEHOLDER]
        assert placeholders in ([], [len(tokens) - 1]), (request.request_id, placeholders)
        assert [t for t in tokens if t != PLACEHOLDER] == list(truth[: len(tokens) - len(placeholders)])

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> tuple[SchedulerOutput, dict[str, int]]:
        scheduler = self.scheduler
        before = {rid: r.status for rid, r in scheduler._requests.items()}
        # A placeholder may stand only for the token the step in flight samples.
        pending = {(row.request.request_id, row.end) for row in self.pending[0].rows if row.is_sampling} \
            if self.pending else set()
        output = scheduler.schedule()
        return output, self._run(output, before, pending)

    def _run(self, output: SchedulerOutput, before: dict, pending: set) -> dict[str, int]:
        bs, scheduler = self.bs, self.scheduler
        seen, slots = set(), set()
        has_row = {row.request.request_id for row in output.rows}
        # Admission never preempts (module doc): a request waiting before this step is not
        # preempted by it unless it got a row (and then it was admitted again).
        phantom = [rid for rid in output.preempted if before.get(rid) is RequestStatus.WAITING and rid not in has_row]
        if phantom:
            raise AdmittedThenPreempted(f"step {scheduler._step - 1}: {phantom} admitted and preempted in one "
                                        f"schedule(), with no row (counted as prefix-cache queries and preemptions)")
        for row in output.rows:
            request, rank, start, end = row.request, row.dp_rank, row.start, row.end
            rid, truth = request.request_id, self.truth[row.request.request_id]
            self.num_rows += 1
            assert rid not in seen and (rank, row.slot) not in slots
            seen.add(rid)
            slots.add((rank, row.slot))
            assert request.status is RequestStatus.RUNNING and row.slot == request.slot
            assert end > start and end <= len(truth) - 1  # the last output is never fed back
            for p, token in enumerate(row.token_ids, start):
                assert token == truth[p] or (token == PLACEHOLDER and (rid, p) in pending), (rid, p, token)
            assert len(row.compressed_blocks) == math.ceil(end / bs)
            assert row.is_sampling == (end == request.num_tokens)
            admitted = before.get(rid) is RequestStatus.WAITING or rid in output.preempted
            if admitted:
                self.admissions.append((rid, start, request.num_tokens))
                assert start % bs == 0 and start <= request.num_tokens - 1
                assert (row.restore >= 0) == (start > 0)
                if rid not in self.first_start:
                    self.first_start[rid] = start
                    assert request.num_cached_tokens == start, (rid, request.num_cached_tokens, start)
            else:
                assert row.restore < 0
            # The state the row starts from: the snapshot restored before the step, or its slot's own.
            if row.restore >= 0:
                assert start > 0 and start % bs == 0
                assert self.snapshots[rank].get(row.restore) == truth[:start], (rid, start, row.restore)
                self.num_restores += 1
            elif start:
                assert self.slots[rank].get(row.slot) == truth[:start], (rid, start, row.slot)
            # Every block before `start` (shared or its own) holds this sequence's prefix.
            for k in range(start // bs):
                assert self.blocks[rank].get(row.compressed_blocks[k]) == truth[: (k + 1) * bs], (rid, k)
            if start % bs:  # the block it continues holds its positions before `start`
                assert self.blocks[rank].get(row.compressed_blocks[start // bs]) == truth[:start], (rid, start)
            if row.snapshot >= 0:
                assert end % bs == 0
        # The device runs the step: restores first, then writes, then snapshots.
        for row in output.rows:
            if row.restore >= 0:
                self.slots[row.dp_rank][row.slot] = self.snapshots[row.dp_rank][row.restore]
        written: dict[tuple[int, int], str] = {}
        for row in output.rows:
            rank, rid, truth = row.dp_rank, row.request.request_id, self.truth[row.request.request_id]
            cached = scheduler.block_managers[rank]._hash_of
            for k in range(row.start // bs, math.ceil(row.end / bs)):
                block = row.compressed_blocks[k]
                assert (rank, block) not in written and block not in cached, (rid, k, block)
                written[rank, block] = rid
                self.blocks[rank][block] = truth[: min(row.end, (k + 1) * bs)]
            self.slots[rank][row.slot] = truth[: row.end]
        for row in output.rows:  # no row reads a block another row of the step writes
            for block in row.compressed_blocks[: row.start // bs + 1]:
                assert written.get((row.dp_rank, block), row.request.request_id) == row.request.request_id
        for row in output.rows:
            if row.snapshot >= 0:
                self.snapshots[row.dp_rank][row.snapshot] = self.slots[row.dp_rank][row.slot]
        return {row.request.request_id: self.truth[row.request.request_id][row.end]
                for row in output.rows if row.is_sampling}

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        got = self.scheduler.update(output, sampled)
        for request in got:
            self.check_tokens(request)
            if request.status.finished:
                assert request.status is RequestStatus.FINISHED_LENGTH
                assert request.all_token_ids == list(self.truth[request.request_id])
        return got

    def step(self, overlap: bool = False, between=None) -> tuple[SchedulerOutput, list[Request]]:
        """One step: synchronous (schedule, run, update), or async (this step scheduled before the
        last one's update). `between(output)` runs after the device ran it, before any update."""
        output, sampled = self.schedule()
        if between is not None:
            between(output)
        got = []
        if overlap:
            if self.pending:
                got = self.update(*self.pending)
            self.pending = (output, sampled) if output.rows else None
        else:
            got = self.update(output, sampled)
        self.scheduler.check_invariants()
        return output, got

    def drain(self, overlap: bool = False, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not (self.scheduler.has_unfinished() or self.pending):
                return
            self.step(overlap)
        raise AssertionError("the scheduler stopped making progress")

    def run(self, request_id: str, prompt: list[int], max_tokens: int) -> Request:
        """Add one request and run everything to the end (synchronously)."""
        request = self.add(request_id, prompt, max_tokens)
        self.drain()
        return request


def assert_all_released(scheduler: Scheduler) -> None:
    """Nothing queued, running or reserved: every block free or cached-evictable, every slot free."""
    scheduler.check_invariants()
    assert not scheduler.has_unfinished() and scheduler.num_running == scheduler.num_waiting == 0
    for bm in scheduler.block_managers:
        assert not any(bm._ref_counts)
        assert bm.num_free_blocks == bm.num_compressed_blocks
        assert bm.num_free_slots == bm.num_seq_slots
    for pool in scheduler.snapshot_pools:
        assert pool.num_reserved == 0


# ---- 1000 requests from a prefix tree -------------------------------------------------------------
MAX_PROMPT, MAX_OUT = 230, 16  # 246 tokens: 16 blocks of 16 (max_blocks_per_seq)


def prefix_tree(rng: random.Random) -> list[list[int]]:
    """A few roots of random tokens and children extending a parent by a random length."""
    nodes = [random_tokens(rng, rng.randint(5, 80)) for _ in range(4)]
    while len(nodes) < 40:
        child = rng.choice(nodes) + random_tokens(rng, rng.randint(1, 60))
        if len(child) <= MAX_PROMPT:
            nodes.append(child)
    return nodes


def draw_prompt(rng: random.Random, nodes: list[list[int]], conversations: list[list[int]]) -> list[int]:
    node, kind = rng.choice(nodes), rng.random()
    if kind < 0.2:
        prompt = node  # equal to a prompt seen before
    elif kind < 0.4:  # diverges from a node, mostly inside a block
        prompt = node[: rng.randint(1, len(node))] + random_tokens(rng, rng.randint(1, 24))
    elif kind < 0.6:  # extends a node, often by several blocks
        prompt = node + random_tokens(rng, rng.randint(1, 100))
    elif kind < 0.72:
        prompt = node[: rng.randint(1, len(node))]
    elif kind < 0.9 and conversations:  # a next turn: a finished request's prompt and output, and more
        prompt = rng.choice(conversations) + random_tokens(rng, rng.randint(1, 30))
    else:
        prompt = random_tokens(rng, rng.randint(1, MAX_PROMPT))
    return prompt[:MAX_PROMPT]




@pytest.mark.parametrize("overlap, dp_size, num_blocks, steps_per_request", [
    *[pytest.param(overlap, dp_size, 32, 2.0, id=f"{'async' if overlap else 'sync'}-dp{dp_size}")
      for overlap in (False, True) for dp_size in (1, 2)],
    # Arrivals twice as fast, or a smaller pool: these runs meet the bug.
    pytest.param(False, 1, 32, 1.0, id="sync-dp1-busier"),
    pytest.param(True, 2, 28, 2.0, id="async-dp2-smaller"),
])
def test_thousand_requests_from_a_prefix_tree_read_only_their_own_prefix(overlap, dp_size, num_blocks,
                                                                         steps_per_request):
    """1000 requests (equal, diverging and extending prompts, next turns) in a pool that forces
    preemptions, with aborts of waiting and running requests and stops after updates: every row
    reads blocks, snapshots and slot state of exactly its own prefix, the hit counters add up the
    admissions' starts, and at the end everything is released."""
    rng = random.Random(20_000 + 10 * dp_size + overlap)
    config = prefix_config(num_compressed_blocks=num_blocks, max_prefill_tokens=48, num_prefix_snapshots=24,
                           dp_size=dp_size)
    scheduler = Scheduler(config)
    device = Device(scheduler)
    nodes, conversations = prefix_tree(rng), []
    num_requests = 1000
    arrivals = sorted(rng.randrange(int(num_requests * steps_per_request) // dp_size) for _ in range(num_requests))
    aborted = {RequestStatus.WAITING: 0, RequestStatus.RUNNING: 0}
    stopped = 0

    def abort(between: bool) -> None:
        """Now and then, a random waiting or running request (before schedule or between
        schedule and update)."""
        for status in (RequestStatus.WAITING, RequestStatus.RUNNING):
            if rng.random() < 0.03 and (rng.random() < 0.5) == between:
                live = sorted(rid for rid, r in scheduler._requests.items() if r.status is status)
                if live:
                    assert scheduler.abort(rng.choice(live))
                    aborted[status] += 1

    step = 0
    while arrivals or scheduler.has_unfinished() or device.pending:
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            rid = f"r{len(device.requests)}"
            device.add(rid, draw_prompt(rng, nodes, conversations), rng.randint(1, MAX_OUT))
        abort(between=False)
        _, got = device.step(overlap, between=lambda _output: abort(between=True))
        for request in got:
            if request.status.finished:
                conversations.append(request.all_token_ids)
            elif rng.random() < 0.05:  # the engine saw a stop token
                assert scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
                device.check_tokens(request)
                stopped += 1
        if not overlap:  # between synchronous steps a running request holds the blocks of what it computed
            for rank, bm in enumerate(scheduler.block_managers):
                for request in scheduler._running[rank]:
                    assert len(request.compressed_blocks) == bm.blocks_for(request.num_computed_tokens)
        step += 1
        assert step < 100_000
    assert len(device.requests) == num_requests
    assert_all_released(scheduler)
    assert scheduler.num_preemptions > 0 and stopped > 0 and min(aborted.values()) > 0, (
        scheduler.num_preemptions, stopped, aborted)
    assert scheduler.prefix_cache_hits > 0 and device.num_restores > 0
    # The counters count each request's first admission (vLLM's): not a preempted request's again.
    first = {}
    for rid, start, tokens in device.admissions:
        first.setdefault(rid, (start, tokens))
    assert scheduler.prefix_cache_hits == sum(start for start, _ in first.values())
    assert scheduler.prefix_cache_queries == sum(tokens for _, tokens in first.values())
    assert len(first) < len(device.admissions)  # re-admissions happened, and were not counted
    assert {rid for rid, _, _ in device.admissions} <= set(device.requests)
    for rid, start in device.first_start.items():
        assert device.requests[rid].num_cached_tokens == start


def test_a_head_admitted_in_a_prefill_first_step_is_not_preempted_by_that_steps_decodes():
    """Two decodes fill the two prefill rows, so steps alternate decode / prefill_first. The head
    (64 tokens, 48 of them cached) fits the 4 free blocks, but in the prefill_first step both
    decodes cross into their second block right after its admission: it should wait for them
    (the decodes never need more than 2 blocks each, so nothing needs preempting at all). It was
    once admitted (its 48 cached tokens counted), preempted with no row, and admitted again later
    with what was cached then."""
    config = prefix_config(max_num_seqs=4, max_model_len=96, num_seq_slots=4, num_compressed_blocks=6,
                           max_blocks_per_seq=6, max_prefill_rows=2, max_prefill_tokens=64, max_decode_rows=4,
                           num_prefix_snapshots=8)
    device = Device(Scheduler(config))
    scheduler = device.scheduler
    rng = random.Random(12)
    head_prompt = random_tokens(rng, 64)
    device.run("warm", head_prompt[:49], 1)
    device.add("d0", random_tokens(rng, 15), 16)
    device.add("d1", random_tokens(rng, 15), 16)
    device.step()  # both prefill; each holds 1 block and needs a 2nd at position 16
    head = device.add("head", head_prompt, 4)
    device.drain()  # Device.schedule raises AdmittedThenPreempted if it is admitted and preempted in one step
    assert scheduler.num_preemptions == head.num_preemptions == 0
    assert head.num_cached_tokens == device.first_start["head"]
    assert scheduler.prefix_cache_hits == device.first_start["head"]  # the only hit: warm, d0, d1 missed
    assert scheduler.prefix_cache_queries == 49 + 15 + 15 + 64
    assert_all_released(scheduler)


# ---- num_cached_tokens ------------------------------------------------------------------------------
def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("length", [64, 70])
def test_num_cached_tokens_is_the_deepest_cached_boundary_before_the_last_token(length):
    """A first request (chunks of one block, so every boundary it computes gets a snapshot) is
    followed by one probe per fresh scheduler: its first admission starts at the deepest block
    boundary that is within the first request's computed full blocks, within the common prefix,
    and before its own last token; num_cached_tokens equals that start."""
    rng = random.Random(length)
    base = random_tokens(rng, length)
    max_tokens = 3  # the first request computes length + 2 positions
    probes = {
        "equal": base,
        "boundary": base[:64],
        "past boundary": base[:65],
        "inside block": base[:40] + random_tokens(rng, 30),
        "one block": base[:16],
        "short": base[:5],
        "miss": random_tokens(rng, 70),
        "next turn": None,  # the first request's prompt and output, then more
        **{f"random {i}": base[: rng.randint(1, length)] + random_tokens(rng, rng.randint(0, 40)) for i in range(6)},
    }
    for name, probe in probes.items():
        device = Device(Scheduler(prefix_config()))
        first = device.run("first", base, max_tokens)
        if probe is None:
            probe = first.all_token_ids + random_tokens(rng, 10)
        computed = first.all_token_ids[:-1]  # the last sample is never fed back
        expected = BS * min(common_prefix(probe, computed) // BS, len(computed) // BS, (len(probe) - 1) // BS)
        hits_before = device.scheduler.prefix_cache_hits
        request = device.run("probe", probe, 2)
        assert request.num_cached_tokens == device.first_start["probe"] == expected, name
        assert request.num_cached_tokens <= len(probe) - 1
        assert device.scheduler.prefix_cache_hits - hits_before == expected
        assert request.all_token_ids == list(device.truth["probe"])
        assert_all_released(device.scheduler)


def test_num_cached_tokens_is_set_at_first_admission_only():
    """A request admitted with no hit and preempted keeps num_cached_tokens 0 when its recompute
    finds its own blocks cached."""
    config = prefix_config(num_compressed_blocks=6, max_blocks_per_seq=6, max_model_len=96)
    device = Device(Scheduler(config))
    rng = random.Random(3)
    old = device.add("old", random_tokens(rng, 16), 60)
    new = device.add("new", random_tokens(rng, 40), 40)
    restarts = []
    while device.scheduler.has_unfinished():
        output, _ = device.step()
        restarts += [row.start for row in output.rows if row.request is new and row.restore >= 0]
    assert new.num_preemptions >= 1 and restarts and max(restarts) > 0
    assert new.num_cached_tokens == 0 and old.num_cached_tokens == 0
    assert device.scheduler.prefix_cache_hits == 0  # a preempted request's recompute is not counted again
    assert_all_released(device.scheduler)


def test_a_request_skipping_the_cache_computes_its_whole_prompt_and_leaves_the_cache_for_others():
    """skip_prefix_cache (prompt logprobs): no hit for it, so no routing by its prefix either (it
    goes to the less loaded rank); the cached blocks stay for the next repeat."""
    device = Device(Scheduler(prefix_config(dp_size=2)))
    rng = random.Random(13)
    prompt = random_tokens(rng, 70)
    first = device.run("first", prompt, 2)
    busy = device.add("busy", random_tokens(rng, 20), 30)
    assert first.dp_rank == busy.dp_rank == 0  # ties: the first rank
    skipping = device.add("skip", prompt, 2, skip_prefix_cache=True)
    assert skipping.dp_rank == 1  # rank 0 holds its prefix, but it looks nothing up
    again = device.add("again", prompt, 2)
    assert again.dp_rank == 0  # the busier rank, holding its prefix
    device.drain()
    assert skipping.num_cached_tokens == device.first_start["skip"] == 0
    assert again.num_cached_tokens == 64
    assert_all_released(device.scheduler)


# ---- data-parallel routing ----------------------------------------------------------------------
def test_dp_routing_follows_the_cached_prefix_even_to_the_busier_rank():
    device = Device(Scheduler(prefix_config(dp_size=2)))
    scheduler = device.scheduler
    rng = random.Random(5)
    long_runner = device.add("busy0", random_tokens(rng, 20), 200)  # keeps rank 0 loaded
    assert long_runner.dp_rank == 0
    a_prompt = random_tokens(rng, 70)
    a = device.add("a", a_prompt, 1)
    assert a.dp_rank == 1  # no hit anywhere: the least loaded rank
    while a.status is not RequestStatus.FINISHED_LENGTH:
        device.step()
    for i in range(3):  # sharing a's first 48 tokens: rank 1, though it gets busier each time
        b = device.add(f"b{i}", a_prompt[:50] + random_tokens(rng, 10), 4)
        assert b.dp_rank == 1
    loads = [len(scheduler._running[k]) + len(scheduler._waiting[k]) for k in range(2)]
    assert loads == [1, 3]
    c = device.add("c", a_prompt + random_tokens(rng, 5), 2)
    assert c.dp_rank == 1
    d = device.add("d", random_tokens(rng, 70), 2)  # no hit anywhere: rank 0, the least loaded
    assert d.dp_rank == 0
    e = device.add("e", random_tokens(rng, 30), 2)
    assert e.dp_rank == 0  # rank 0 holds 2, rank 1 holds 4
    scheduler.abort("busy0")
    device.drain()
    assert [device.requests[f"b{i}"].num_cached_tokens for i in range(3)] == [48, 48, 48]
    assert c.num_cached_tokens == 64 and d.num_cached_tokens == 0 and e.num_cached_tokens == 0
    assert_all_released(scheduler)


def test_dp_routing_leaves_a_rank_a_full_batch_ahead_to_the_others():
    """One warm system prompt must not pin every request to the rank that cached it: once that
    rank holds max_num_seqs more unfinished requests than another, the next goes to the other,
    which computes the prefix once and then hits it too."""
    config = prefix_config(dp_size=2)
    device = Device(Scheduler(config))
    rng = random.Random(9)
    system = random_tokens(rng, 48)
    device.run("warm", system + random_tokens(rng, 5), 1)
    warm_rank = device.requests["warm"].dp_rank
    ranks = [device.add(f"s{i}", system + random_tokens(rng, 8), 8).dp_rank for i in range(3 * config.max_num_seqs)]
    first_other = ranks.index(1 - warm_rank)
    assert ranks[:first_other] == [warm_rank] * first_other and first_other == config.max_num_seqs + 1
    device.drain()
    hits = [device.requests[f"s{i}"].num_cached_tokens for i in range(len(ranks))]
    assert all(h == 48 for h, r in zip(hits, ranks) if r == warm_rank)
    assert any(h == 48 for h, r in zip(hits, ranks) if r != warm_rank)  # the other rank caught up
    assert_all_released(device.scheduler)


def test_dp_routing_without_any_hit_goes_to_the_least_loaded_rank():
    """Unrelated prompts, added and aborted at random: each goes to a rank holding the fewest
    unfinished requests (counted here, apart from the scheduler)."""
    device = Device(Scheduler(prefix_config(dp_size=2, max_num_seqs=4)))
    rng = random.Random(6)
    live = {0: [], 1: []}
    for i in range(40):
        if live[0] + live[1] and rng.random() < 0.4:
            rid = rng.choice(sorted(live[0] + live[1]))
            assert device.scheduler.abort(rid)
            live[0 if rid in live[0] else 1].remove(rid)
        request = device.add(f"x{i}", random_tokens(rng, rng.randint(1, 40)), 50)
        loads = [len(live[0]), len(live[1])]
        assert loads[request.dp_rank] == min(loads), (i, loads, request.dp_rank)
        live[request.dp_rank].append(request.request_id)
    device.drain()
    assert_all_released(device.scheduler)
    assert device.scheduler.prefix_cache_hits == 0


# ---- reset_prefix_cache -------------------------------------------------------------------------
def test_reset_prefix_cache_is_refused_while_requests_live_then_forgets_every_hit():
    device = Device(Scheduler(prefix_config()))
    scheduler = device.scheduler
    rng = random.Random(7)
    prompt = random_tokens(rng, 50)
    first = device.add("first", prompt, 4)
    assert scheduler.reset_prefix_cache() is False  # queued
    device.step()
    assert first.status is RequestStatus.RUNNING and scheduler.reset_prefix_cache() is False
    device.drain()
    assert scheduler.block_managers[0].num_cached_blocks > 0
    again = device.run("again", prompt, 2)
    assert again.num_cached_tokens == 48  # the control: without a reset, the repeat hits
    assert scheduler.reset_prefix_cache() is True
    bm, pool = scheduler.block_managers[0], scheduler.snapshot_pools[0]
    assert bm.num_cached_blocks == 0 and pool.num_cached == 0
    assert_all_released(scheduler)
    repeat = device.run("repeat", prompt, 2)
    assert repeat.num_cached_tokens == 0 and device.first_start["repeat"] == 0
    assert repeat.all_token_ids == list(device.truth["repeat"])
    assert_all_released(scheduler)


def test_reset_prefix_cache_with_a_step_in_flight_keeps_its_reserved_snapshots_consistent():
    """An aborted request's step still in flight (async): the reset is allowed, and its reserved
    snapshot goes back at the update."""
    device = Device(Scheduler(prefix_config()))
    scheduler = device.scheduler
    device.add("a", random_tokens(random.Random(8), 40), 4)
    output, _ = device.step(overlap=True)
    assert output.rows[0].snapshot >= 0 and scheduler.snapshot_pools[0].num_reserved == 1
    assert scheduler.abort("a") and scheduler.reset_prefix_cache() is True
    scheduler.check_invariants()
    device.drain(overlap=True)
    assert_all_released(scheduler)


# ---- eviction -----------------------------------------------------------------------------------
def test_unheld_cached_blocks_are_evicted_least_recently_released_first_with_their_snapshots():
    """8 blocks; a, b and c (49 tokens: 3 full blocks and one more) run one after another. c takes
    the 2 uncached free blocks, then evicts the least recently released cached ones: a's last two
    (a releases its last block first), whose snapshots go with them. A repeat of b still hits all
    its 3 blocks; a repeat of a hits only its first block."""
    config = prefix_config(num_compressed_blocks=8, max_blocks_per_seq=8, max_model_len=64)
    device = Device(Scheduler(config))
    scheduler = device.scheduler
    bm, pool = scheduler.block_managers[0], scheduler.snapshot_pools[0]
    rng = random.Random(9)
    prompts = {name: random_tokens(rng, 49) for name in "abc"}
    for name in "ab":
        device.run(name, prompts[name], 1)
    assert (bm.num_cached_blocks, pool.num_cached) == (6, 6)
    device.run("c", prompts["c"], 1)
    assert (bm.num_cached_blocks, pool.num_cached) == (7, 7)  # a's last two evicted, c's three cached
    b2 = device.run("b2", prompts["b"], 1)
    assert b2.num_cached_tokens == 48
    a2 = device.run("a2", prompts["a"], 1)
    assert a2.num_cached_tokens == 16  # shallower: only a's first block (and its snapshot) survived
    for name in ("b2", "a2"):
        assert device.requests[name].all_token_ids == list(device.truth[name])
    assert_all_released(scheduler)


@pytest.mark.parametrize("cut, expected", [(49, 48), (40, 32), (20, 0)])
def test_snapshots_beyond_the_pool_evict_the_least_recently_used(cut, expected):
    """Two snapshot ids for a 49-token prompt computed block by block: the snapshot at 16 is
    evicted for the one at 48, so every block stays cached, but a prefix ending in the first block
    has no state to restore and misses."""
    device = Device(Scheduler(prefix_config(num_prefix_snapshots=2)))
    prompt = random_tokens(random.Random(10), 49)
    device.run("a", prompt, 1)
    assert device.scheduler.block_managers[0].num_cached_blocks == 3
    assert device.scheduler.snapshot_pools[0].num_cached == 2
    probe = device.run("probe", prompt[:cut] + [1], 2)
    assert probe.num_cached_tokens == expected
    assert probe.all_token_ids == list(device.truth["probe"])
    assert_all_released(device.scheduler)


# ---- hash algorithms ------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_block_hasher_digests_depend_on_parent_and_tokens(algo):
    if algo.startswith("xxhash"):
        pytest.importorskip("xxhash")
    if algo.endswith("_cbor"):
        pytest.importorskip("cbor2")
    h = block_hasher(algo)
    root = root_hash(h, "model-a")
    assert root == root_hash(block_hasher(algo), "model-a") != root_hash(h, "model-b")
    tokens = list(range(1000, 1016))
    digest = h(root, tokens)
    assert isinstance(digest, bytes) and len(digest) >= 16
    assert digest == h(root, list(tokens)) == block_hasher(algo)(root, tuple(tokens))
    variants = [h(root, tokens[:-1] + [tokens[-1] + 1]), h(root, tokens[::-1]), h(root, tokens[:-1]),
                h(root, [t + 2**20 for t in tokens]), h(digest, tokens), h(root_hash(h, "model-b"), tokens)]
    assert len({digest, *variants}) == len(variants) + 1
    chained = [root]
    for k in range(5):
        chained.append(h(chained[-1], tokens))
    assert len(set(chained)) == len(chained)  # the same tokens under different parents differ


def test_unknown_hash_algo_names_the_flag():
    with pytest.raises(ValueError, match="--prefix-caching-hash-algo"):
        block_hasher("md5")
    with pytest.raises(ValueError, match="--prefix-caching-hash-algo"):
        prefix_config(prefix_caching_hash_algo="sha1")


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash"])
def test_other_hash_algos_drive_the_same_hits(algo):
    pytest.importorskip("xxhash" if algo.startswith("xxhash") else "cbor2")
    device = Device(Scheduler(prefix_config(prefix_caching_hash_algo=algo)))
    prompt = random_tokens(random.Random(11), 70)
    device.run("a", prompt, 2)
    assert device.run("b", prompt, 2).num_cached_tokens == 64
    assert_all_released(device.scheduler)


def test_a_prefix_cached_past_its_deepest_snapshot_gets_one_there():
    """Chunks longer than a block (48-token chunks, 16-token blocks) end past a shared 40-token
    prefix, so the first request leaves its blocks cached but no snapshot at their end. The next
    request's first chunk ends where the cached blocks end (a snapshot is taken there), and every
    request after it hits all of them."""
    device = Device(Scheduler(prefix_config(max_prefill_tokens=48)))
    rng = random.Random(21)
    shared = random_tokens(rng, 40)
    for i in range(5):
        device.run(f"r{i}", shared + random_tokens(rng, 20), 2)
    assert [device.requests[f"r{i}"].num_cached_tokens for i in range(5)] == [0, 0, 32, 32, 32]
    assert_all_released(device.scheduler)
