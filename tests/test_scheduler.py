"""Scheduler and block manager, on the host only: a fake runner stores each row's tokens in the
blocks the row names and a fake sampler emits a token fixed by (request, output index), so a
request's output and its cached sequence are known independently of the scheduler."""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
import types
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_jax.engine.block_manager import BlockManager
from dsv4_jax.engine.request import PLACEHOLDER, Request, RequestRejected, RequestStatus
from dsv4_jax.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

# Small pools: 600 + 64 tokens need 42 blocks of 16, and 96 blocks hold few such requests at once,
# so long runs preempt often.
CONFIG = SchedulerConfig(
    max_num_seqs=12, max_model_len=704, num_seq_slots=14, num_compressed_blocks=96, block_size=16,
    max_blocks_per_seq=44, max_prefill_rows=4, max_prefill_tokens=128, max_decode_rows=16,
)


def sampled_token(request_id: str, index: int) -> int:
    """The fake sampler: never EOS, fixed by the request and the output index."""
    return (zlib.crc32(request_id.encode()) + 7919 * index) % 50_000


def new_request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(request_id, [(7 * i + len(request_id)) % 1000 for i in range(prompt_len)], max_tokens)


class FakeRunner:
    """Checks each step against the limits and writes its tokens into per-rank block pools."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.pools = [{} for _ in range(config.dp_size)]  # block id -> {offset: (request id, position, token)}
        self.slot_end = [{} for _ in range(config.dp_size)]  # slot -> (request id, positions written)

    def step(self, output: SchedulerOutput, previous: dict[str, int] | None = None) -> dict[str, int]:
        """`previous`: the last step's samples, which stand in for PLACEHOLDER tokens (async
        scheduling: the real runner reads them on the device)."""
        c, sampled = self.config, {}
        self.previous = previous or {}
        # One step is one bucket for every rank: when any row is a prefill chunk, every rank's
        # rows must fit a prefill bucket.
        if any(len(row.token_ids) > 1 for row in output.rows):
            assert all(len(output.rows_of(rank)) <= c.max_prefill_rows for rank in range(c.dp_size))
        for rank in range(c.dp_size):
            rows = output.rows_of(rank)
            lengths = [len(row.token_ids) for row in rows]
            assert sum(lengths) <= c.max_num_batched_tokens
            if max(lengths, default=1) == 1:
                assert len(rows) <= max(c.max_decode_rows, c.max_prefill_rows)
            else:
                assert len(rows) <= c.max_prefill_rows and max(lengths) <= c.max_prefill_tokens
            assert len({row.slot for row in rows}) == len(rows)
            for row in rows:
                self._write(rank, row)
                if row.is_sampling:
                    request = row.request
                    sampled[request.request_id] = sampled_token(request.request_id, request.num_output_tokens)
        return sampled

    def _write(self, rank: int, row) -> None:
        request, n, bs = row.request, len(row.token_ids), self.config.block_size
        assert n >= 1 and 0 <= row.slot < self.config.num_seq_slots
        # Rows of a sequence cover positions 0..n-1 contiguously; a recompute restarts at 0.
        if row.start:
            assert self.slot_end[rank][row.slot] == (request.request_id, row.start)
        assert list(row.token_ids) == request.all_token_ids[row.start : row.start + n]
        assert len(row.compressed_blocks) == math.ceil((row.start + n) / bs)
        assert row.is_sampling == (row.start + n == request.num_tokens)
        for p in range(row.start, row.start + n):
            block = self.pools[rank].setdefault(row.compressed_blocks[p // bs], {})
            token = row.token_ids[p - row.start]
            block[p % bs] = (request.request_id, p, self.previous[request.request_id] if token == PLACEHOLDER else token)
        self.slot_end[rank][row.slot] = (request.request_id, row.start + n)

    def read_back(self, request: Request, blocks: list[int], rank: int) -> list[int]:
        """The tokens cached for `request`, checking every entry was written by it."""
        tokens = []
        for p in range(request.num_tokens - 1):
            owner, position, token = self.pools[rank][blocks[p // self.config.block_size]][p % self.config.block_size]
            assert (owner, position) == (request.request_id, p)
            tokens.append(token)
        return tokens


def check_holdings(scheduler: Scheduler) -> None:
    """Between steps: only running requests hold anything, no two share a slot or a block, and
    each holds exactly the blocks of the positions it has written."""
    for rank, bm in enumerate(scheduler.block_managers):
        bm.check_invariants()
        running = scheduler._running[rank]
        assert len(running) <= scheduler.config.max_num_seqs
        assert set(bm._holders) == {r.request_id for r in running}  # so waiting requests hold nothing
        slots = [r.slot for r in running]
        blocks = [b for r in running for b in r.compressed_blocks]
        assert len(set(slots)) == len(slots) and None not in slots
        assert len(set(blocks)) == len(blocks)
        for r in running:
            assert len(r.compressed_blocks) == bm.blocks_for(r.num_computed_tokens)


def simulate(config: SchedulerConfig, num_requests: int, max_prompt: int, max_out: int, abort_share: float,
             seed: int, overlap: bool = False) -> Scheduler:
    """Random arrivals and aborts (a share of the requests, some steps after arrival, before
    scheduling or between schedule and update) run to the end; checks every step and every
    finished request. `overlap`: async scheduling, each step scheduled before the last one's
    update (its tokens still placeholders)."""
    rng = random.Random(seed)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    arrivals = sorted((rng.randrange(num_requests + 1), i) for i in range(num_requests))
    specs = {f"r{i}": (rng.randint(1, max_prompt), rng.randint(1, max_out)) for i in range(num_requests)}
    abort_at = {(t + rng.randrange(3 * max_out), rng.random() < 0.5): f"r{i}" for t, i in arrivals
                if rng.random() < abort_share}  # (step, between schedule and update) -> request id
    aborted, finished, step = set(), {}, 0
    in_flight = None  # (output, sampled, blocks) of a step scheduled but not updated (overlap)

    def apply(output, sampled, blocks) -> None:
        for request in scheduler.update(output, sampled):
            if request.status.finished:
                assert request.status is RequestStatus.FINISHED_LENGTH
                finished[request.request_id] = request
                if request.num_computed_tokens == 0:  # preempted after its last step (overlap): no cache left
                    continue
                cached = runner.read_back(request, blocks[request.request_id], request.dp_rank)
                assert cached == request.all_token_ids[:-1]

    while arrivals or scheduler.has_unfinished() or in_flight:
        while arrivals and arrivals[0][0] <= step:
            rid = f"r{arrivals.pop(0)[1]}"
            scheduler.add(new_request(rid, *specs[rid]))
        if scheduler.abort(abort_at.get((step, False), "")):
            aborted.add(abort_at[step, False])
        output = scheduler.schedule()
        for bm in scheduler.block_managers:
            bm.check_invariants()
        sampled = runner.step(output, in_flight[1] if in_flight else None)
        blocks = {row.request.request_id: list(row.compressed_blocks) for row in output.rows}
        if scheduler.abort(abort_at.get((step, True), "")):
            aborted.add(abort_at[step, True])
        if overlap:
            if in_flight:
                apply(*in_flight)
            in_flight = (output, sampled, blocks) if output.rows else None
        else:
            apply(output, sampled, blocks)
            check_holdings(scheduler)
        step += 1
        assert step < 50 * num_requests * (max_prompt + max_out), "the scheduler stopped making progress"
    assert set(finished) | aborted == set(specs) and not set(finished) & aborted
    for rid, request in finished.items():
        prompt_len, max_tokens = specs[rid]
        assert request.output_token_ids == [sampled_token(rid, k) for k in range(max_tokens)]
        assert len(request.prompt_token_ids) == prompt_len
    for bm in scheduler.block_managers:
        bm.check_invariants()
        assert (bm.num_free_slots, bm.num_free_blocks) == (config.num_seq_slots, config.num_compressed_blocks)
        assert not any(bm._ref_counts)
    assert scheduler.num_running == scheduler.num_waiting == 0
    return scheduler


@pytest.mark.parametrize("overlap", [False, True])
def test_thousand_mixed_requests_with_aborts_and_preemption_run_to_completion(overlap):
    scheduler = simulate(CONFIG, num_requests=1000, max_prompt=600, max_out=64, abort_share=0.1, seed=0,
                         overlap=overlap)
    assert scheduler.num_preemptions > 20  # the small cap did force recomputes


@settings(max_examples=25, deadline=None, database=None)
@given(
    block_size=st.sampled_from([4, 16]), cap=st.integers(12, 40), rows=st.integers(1, 4),
    tokens=st.integers(2, 40), decode_rows=st.integers(1, 6), max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 80), chunked=st.booleans(), dp_size=st.integers(1, 2), seed=st.integers(0, 2**16),
)
def test_random_limits_keep_every_invariant(block_size, cap, rows, tokens, decode_rows, max_num_seqs, budget,
                                            chunked, dp_size, seed):
    max_prompt = min(tokens, budget) if not chunked else 40
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_model_len=max_prompt + 8, num_seq_slots=6,
        num_compressed_blocks=max(cap, math.ceil((max_prompt + 7) / block_size)),
        block_size=block_size, max_blocks_per_seq=40, max_prefill_rows=rows, max_prefill_tokens=tokens,
        max_decode_rows=decode_rows, max_num_batched_tokens=budget, enable_chunked_prefill=chunked, dp_size=dp_size,
    )
    simulate(config, num_requests=24, max_prompt=max_prompt, max_out=8, abort_share=0.1, seed=seed)


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt_len, max_tokens, overrides, expected, param",
    [
        (0, 4, {}, "prompt is empty", "prompt"),
        (700, 5, {}, "prompt 700 + max_tokens 5 = 705 tokens exceed max_model_len=704", "max_tokens"),
        (10, 0, {}, "max_tokens must be an int >= 1, got 0", "max_tokens"),
        (500, 100, {}, "599 cached positions need 38 compressed blocks of 16, more than the 30 usable", "max_tokens"),
        (600, 64, {"num_compressed_blocks": 96, "max_blocks_per_seq": 41}, "need 42 compressed blocks", "max_tokens"),
        (129, 1, {"enable_chunked_prefill": False},
         "prompt 129 is longer than one prefill row (max_prefill_tokens=128", "prompt"),
    ],
)
def test_add_refuses_a_request_that_can_never_run(prompt_len, max_tokens, overrides, expected, param):
    """With the numbers, and the request field to change (the server's OpenAI error `param`)."""
    config = SchedulerConfig(**{**vars(CONFIG), "num_compressed_blocks": 30, **overrides})
    scheduler = Scheduler(config)
    with pytest.raises(RequestRejected, match=re.escape(expected)) as refused:
        scheduler.add(new_request("big", prompt_len, max_tokens))
    assert isinstance(refused.value, ValueError) and refused.value.param == param
    assert not scheduler.has_unfinished()


@given(st.integers(0, 6), st.integers(0, 6), st.data())
def test_a_chunk_of_token_ids_is_the_slice_of_prompt_then_outputs(prompt_len, output_len, data):
    request = Request("r", list(range(100, 100 + prompt_len)), max_tokens=8)
    request.output_token_ids = list(range(200, 200 + output_len))
    whole = [*range(100, 100 + prompt_len), *range(200, 200 + output_len)]
    start = data.draw(st.integers(0, len(whole)))
    stop = data.draw(st.integers(start, len(whole)))
    assert request.token_ids(start, stop) == whole[start:stop]


def test_config_and_block_manager_name_bad_values():
    with pytest.raises(ValueError, match=r"SchedulerConfig.max_num_seqs must be an int >= 1, got 0"):
        SchedulerConfig(**{**vars(CONFIG), "max_num_seqs": 0})
    scheduler = Scheduler(CONFIG)
    scheduler.add(new_request("a", 3, 2))
    with pytest.raises(ValueError, match="request id 'a' is already queued"):
        scheduler.add(new_request("a", 3, 2))


def test_config_defaults_and_runner_limits():
    assert CONFIG.max_num_batched_tokens == 4 * 128
    buckets = types.SimpleNamespace(prefill=((4, 64), (8, 256)), decode=(8, 32))  # StepBuckets' fields
    layout = types.SimpleNamespace(num_seq_slots=3, num_compressed_blocks=50, block_size=64, max_blocks_per_seq=9)
    config = SchedulerConfig.for_runner(buckets, layout, max_num_seqs=3, max_model_len=512)
    assert (config.max_prefill_rows, config.max_prefill_tokens, config.max_decode_rows) == (8, 256, 32)
    assert (config.num_compressed_blocks, config.block_size, config.max_num_batched_tokens) == (50, 64, 2048)


# ---- one step at a time -------------------------------------------------------------------------
def run_step(scheduler: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, runner.step(output))
    return output


def test_prompt_is_chunked_and_only_the_last_chunk_samples():
    scheduler = Scheduler(CONFIG)
    runner = FakeRunner(CONFIG)
    scheduler.add(new_request("long", 300, 2))
    chunks = [run_step(scheduler, runner).rows for _ in range(3)]
    assert [(r.start, len(r.token_ids), r.is_sampling) for (r,) in chunks] == [(0, 128, False), (128, 128, False),
                                                                               (256, 44, True)]
    # Each row keeps the blocks of its own step (ceil(end / 16)), though the request grew since.
    assert [len(r.compressed_blocks) for (r,) in chunks] == [8, 16, 19]
    assert chunks[0][0].compressed_blocks.tolist() == chunks[2][0].compressed_blocks.tolist()[:8]
    (decode,) = run_step(scheduler, runner).rows
    assert (decode.start, decode.token_ids) == (300, (sampled_token("long", 0),))
    assert not scheduler.has_unfinished()  # max_tokens 2 reached: finished by length


def test_abort_between_schedule_and_update_is_ignored_and_frees_everything():
    scheduler = Scheduler(CONFIG)
    scheduler.add(new_request("a", 20, 4))
    scheduler.add(new_request("b", 20, 4))
    output = scheduler.schedule()
    held = output.rows[0].request.compressed_blocks.tolist()
    assert scheduler.abort("a") and not scheduler.abort("a")
    a = output.rows[0].request
    assert a.status is RequestStatus.FINISHED_ABORTED and a.slot is None and not a.compressed_blocks
    assert output.rows[0].compressed_blocks.tolist() == held == [0, 1]  # the row's copy, as scheduled
    got = scheduler.update(output, {"b": 5})  # the engine sampled only "b"
    assert [r.request_id for r in got] == ["b"] and a.num_computed_tokens == 0 and not a.output_token_ids
    assert scheduler.finish("b", RequestStatus.FINISHED_STOPPED)
    bm = scheduler.block_managers[0]
    bm.check_invariants()
    assert (bm.num_free_slots, bm.num_free_blocks, bm.usage) == (14, 96, 0.0)
    with pytest.raises(ValueError, match="finish\\(\\) takes a finished status"):
        scheduler.finish("b", RequestStatus.RUNNING)


def test_a_third_schedule_and_updates_out_of_order_are_refused():
    scheduler = Scheduler(CONFIG)
    scheduler.add(new_request("a", 5, 4))
    first = scheduler.schedule()
    second = scheduler.schedule()  # async scheduling: the first is taken as done
    assert first.rows[0].request.output_token_ids == [PLACEHOLDER]
    assert second.rows[0].token_ids == (PLACEHOLDER,) and second.rows[0].start == 5
    with pytest.raises(RuntimeError, match="two steps not updated"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="oldest step not updated"):
        scheduler.update(second, {"a": 2})
    with pytest.raises(ValueError, match=r"no sampled token for the sampling rows of requests \['a'\]"):
        scheduler.update(first, {})
    scheduler.update(first, {"a": 1})
    assert first.rows[0].request.output_token_ids == [1]
    with pytest.raises(ValueError, match="oldest step not updated"):
        scheduler.update(first, {"a": 1})
    scheduler.update(second, {"a": 2})
    assert first.rows[0].request.output_token_ids == [1, 2]


def test_preemption_frees_the_newest_and_it_recomputes_prompt_and_output():
    config = SchedulerConfig(**{**vars(CONFIG), "num_compressed_blocks": 3})
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.add(new_request("old", 16, 20))
    scheduler.add(new_request("new", 15, 20))
    run_step(scheduler, runner)  # both prefill: 1 block each; then both decode until blocks run out
    while not scheduler.num_preemptions:
        output = run_step(scheduler, runner)
    assert output.preempted == ("new",) and scheduler.num_waiting == 1
    new = scheduler._requests["new"]
    assert (new.status, new.num_computed_tokens, new.slot) == (RequestStatus.WAITING, 0, None)
    assert not new.compressed_blocks
    outputs_before = list(new.output_token_ids)
    while scheduler.has_unfinished():
        output = run_step(scheduler, runner)
        for row in output.rows:
            if row.request is new and row.start == 0:  # the recompute: prompt and output so far
                assert row.token_ids == tuple(new.prompt_token_ids + outputs_before)[: len(row.token_ids)]
    assert new.output_token_ids == [sampled_token("new", k) for k in range(20)] and new.num_preemptions >= 1



def test_a_prompt_is_admitted_only_when_all_its_blocks_fit():
    """Four 780-token prompts (4 blocks of 256 each, for all 980 positions too) in 10 blocks, chunks
    of 256: two run at once, and the other two wait until the first two finish. Admitted on its
    first chunk's blocks alone, the third preempted itself at its second chunk and was admitted
    again, 202 times over (the server thrashed: its prefill redone each time)."""
    config = SchedulerConfig(max_num_seqs=8, max_model_len=1024, num_seq_slots=8, num_compressed_blocks=10,
                             block_size=256, max_blocks_per_seq=4, max_prefill_rows=8, max_prefill_tokens=256,
                             max_decode_rows=8)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    for i in range(4):
        scheduler.add(new_request(f"r{i}", 780, 200))
    computed = {f"r{i}": 0 for i in range(4)}
    first_token_step = {}
    for step in range(1000):
        if not scheduler.has_unfinished():
            break
        for row in run_step(scheduler, runner).rows:
            computed[row.request.request_id] += len(row.token_ids)
            if row.is_sampling:
                first_token_step.setdefault(row.request.request_id, step)
    assert not scheduler.has_unfinished() and scheduler.num_preemptions == 0
    assert computed == {f"r{i}": 780 + 199 for i in range(4)}  # each position once; the last token is not fed
    assert first_token_step["r1"] < 10 < 200 < first_token_step["r2"]  # two at once, then the other two
    scheduler.block_managers[0].check_invariants()


def decoding(config: SchedulerConfig, count: int, prompt_len: int, max_tokens: int) -> tuple[Scheduler, FakeRunner]:
    """A scheduler whose requests d0, d1, ... (`count`) have all been admitted and are decoding."""
    scheduler, runner = Scheduler(config), FakeRunner(config)
    for i in range(count):
        scheduler.add(new_request(f"d{i}", prompt_len, max_tokens))
    while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler._running[0]):
        run_step(scheduler, runner)
    return scheduler, runner


def test_decodes_keep_every_row_while_the_queue_head_waits_for_blocks():
    """Four decoding requests hold 16 of 24 blocks; a 300-token prompt (19 blocks) must wait until
    they finish. Meanwhile every step is a decode step with all four: a prefill step for a head
    that cannot be admitted would hold only max_prefill_rows = 2 of them."""
    config = SchedulerConfig(**{**vars(CONFIG), "max_prefill_rows": 2, "num_compressed_blocks": 24})
    scheduler, runner = decoding(config, 4, 60, 30)
    scheduler.add(new_request("long", 300, 2))
    steps = 0
    while scheduler.num_waiting:
        running = sorted(r.request_id for r in scheduler._running[0])
        served = sorted(row.request.request_id for row in run_step(scheduler, runner).rows)
        assert [rid for rid in served if rid != "long"] == running
        steps += 1
    assert steps > 20
    while scheduler.has_unfinished():
        run_step(scheduler, runner)
    assert scheduler.num_preemptions == 0


def test_decodes_filling_a_prefill_step_alternate_with_prefill_steps():
    config = SchedulerConfig(**{**vars(CONFIG), "max_prefill_rows": 2, "max_num_seqs": 6})
    scheduler, runner = decoding(config, 5, 3, 60)
    scheduler.add(new_request("late", 200, 2))
    served = [{row.request.request_id for row in run_step(scheduler, runner).rows} for _ in range(8)]
    late_steps = [i for i, ids in enumerate(served) if "late" in ids]
    assert late_steps[:2] in ([0, 2], [1, 3])  # a prefill chunk every other step
    for i in range(5):  # and no decode waits more than two steps
        assert all(f"d{i}" in served[s] | served[s + 1] for s in range(7))


def test_decodes_beyond_a_steps_rows_take_turns():
    config = SchedulerConfig(**{**vars(CONFIG), "max_decode_rows": 2, "max_prefill_rows": 2})
    scheduler, runner = decoding(config, 5, 3, 40)
    served = [{row.request.request_id for row in run_step(scheduler, runner).rows} for _ in range(9)]
    assert all(len(ids) == 2 for ids in served)
    for s in range(7):  # the least recently served go first: everyone within 3 steps
        assert served[s] | served[s + 1] | served[s + 2] == {f"d{i}" for i in range(5)}


def test_dp_ranks_have_independent_allocators_and_their_own_max_num_seqs():
    config = SchedulerConfig(**{**vars(CONFIG), "dp_size": 2, "max_num_seqs": 2})
    scheduler, runner = Scheduler(config), FakeRunner(config)
    for i in range(6):
        scheduler.add(new_request(f"r{i}", 20, 3))
    assert [scheduler._requests[f"r{i}"].dp_rank for i in range(6)] == [0, 1, 0, 1, 0, 1]
    output = run_step(scheduler, runner)
    for rank in (0, 1):
        rows = output.rows_of(rank)
        assert [row.request.request_id for row in rows] == [f"r{rank}", f"r{rank + 2}"]
        assert sorted(row.slot for row in rows) == [0, 1]  # each rank numbers its own slots
        bm = scheduler.block_managers[rank]
        assert bm.num_free_blocks == 96 - 4 and bm.num_free_slots == 12
    scheduler.abort("r0")
    assert [bm.num_free_blocks for bm in scheduler.block_managers] == [94, 92]
    assert scheduler.num_running == 3 and scheduler.num_waiting == 2 and scheduler.kv_cache_usage == pytest.approx(
        (2 / 96 + 4 / 96) / 2)


def test_a_rank_that_only_decodes_fits_the_prefill_bucket_another_rank_needs():
    """Rank 0 runs more decodes than a prefill bucket holds; when rank 1 prefills, rank 0's rows
    in that step are capped at the prefill bucket's rows (one bucket per step), and the decodes
    left out are served in the next steps."""
    config = SchedulerConfig(**{**vars(CONFIG), "dp_size": 2, "max_prefill_rows": 2, "max_decode_rows": 8})
    scheduler, runner = Scheduler(config), FakeRunner(config)
    for i in range(5):
        scheduler.add(new_request(f"d{i}", 3, 60))
    for request in list(scheduler._waiting[1]):  # keep every decode on rank 0
        scheduler._waiting[1].remove(request)
        request.dp_rank = 0
        scheduler._waiting[0].append(request)
    while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler._running[0]):
        run_step(scheduler, runner)
    assert len(run_step(scheduler, runner).rows_of(0)) == 5  # decode-only steps take all five
    late = new_request("late", 200, 2)
    scheduler.add(late)
    assert late.dp_rank == 1
    output = run_step(scheduler, runner)
    assert [row.request.request_id for row in output.rows_of(1)] == ["late"]
    assert len(output.rows_of(0)) == 2 and len(output.rows_of(1)[0].token_ids) > 1


def test_block_manager_counts_and_refuses_what_it_cannot_hold():
    bm = BlockManager(num_seq_slots=2, num_compressed_blocks=5, block_size=4, max_blocks_per_seq=3)
    a, b = new_request("a", 1, 1), new_request("b", 1, 1)
    assert bm.allocate_slot(a) == 0 and bm.allocate_blocks(a, 9) and a.compressed_blocks.tolist() == [0, 1, 2]
    assert bm.allocate_blocks(a, 12) and len(a.compressed_blocks) == 3  # already covered
    assert not bm.allocate_blocks(b, 9) and not b.compressed_blocks  # 2 free: nothing taken
    with pytest.raises(ValueError, match="13 tokens need 4 compressed blocks of 4, more than max_blocks_per_seq=3"):
        bm.allocate_blocks(a, 13)
    assert (bm.num_free_blocks, bm.usage) == (2, pytest.approx(0.6))
    bm.check_invariants()
    a.compressed_blocks.append(4)  # a block nobody allocated: the invariant check must see it
    with pytest.raises(RuntimeError, match="block 4: reference count 0, listed by holders 1 times"):
        bm.check_invariants()
    a.compressed_blocks.pop()
    bm.free(a)
    bm.check_invariants()
    assert (bm.num_free_slots, bm.num_free_blocks, a.slot) == (2, 5, None)


def test_scheduler_modules_import_no_jax():
    code = ("import sys, dsv4_jax.engine.scheduler, dsv4_jax.engine.block_manager; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'numpy')], 'jax'")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
