"""Prefix caching through the real engine (float32 cache): a request that hits equals the same
request computed from scratch, and what the cache holds is accounted for.

The reference for a request is the same engine with its cache emptied (`reset_prefix_cache`), so
that it misses: the same compiled programs, only the prefix's computation differs. The tiny
model has a sliding window of 4 and compression windows of 4 (CSA) and 16 (HCA); blocks are 128
tokens, so every hit is longer than the window and than several compression windows. The engine
is tests/test_engine.py's (`tiny_engine_args`) with caching on: the same layout and buckets, so
its steps and sampler are the programs that file compiled (caching adds the two snapshot copies).
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_jax import LLM, SamplingParams
from dsv4_jax.engine.args import EngineArgs
from dsv4_jax.presets import get_config
from dsv4_jax.testing import write_random_checkpoint

from conftest import TINY_ENGINE_LAYERS, capped_block_manager, tiny_engine_args  # tests/ is on sys.path

CONFIG = get_config("dsv4-tiny-test").replace(**TINY_ENGINE_LAYERS)
BLOCK = 128
USABLE_BLOCKS = 6  # of the pool's 10: four running requests of up to 2 blocks each preempt
ARGS = {**tiny_engine_args(), "enable_prefix_caching": True, "num_prefix_snapshots": 4}
GAP = 1e-3  # top-1/top-2 logprob gap below which two runs may pick different tokens
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("prefix") / "ckpt", CONFIG, seed=6)
    return LLM.from_engine_args(EngineArgs(str(checkpoint), **ARGS),
                                block_manager_factory=capped_block_manager(USABLE_BLOCKS))


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, CONFIG.vocab_size, size=n).tolist()


def _generate(llm, prompts, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _miss(llm, prompt, max_tokens=12):
    assert llm.reset_prefix_cache()
    (out,) = _generate(llm, [prompt], max_tokens)
    assert out.num_cached_tokens == 0
    assert llm.reset_prefix_cache()
    return out


def _assert_same_run(got, want) -> int:
    """Greedy outputs equal, logprobs within LOGPROB_TOL, up to a first difference at a near-tie
    of the reference (which ends the comparison). Returns the positions compared."""
    a, b = got.outputs[0], want.outputs[0]
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        top = sorted((lp.logprob for lp in b.logprobs[i].values()), reverse=True)
        if x != y:
            assert top[0] - top[1] <= GAP, f"position {i}: {x} != {y} with a gap of {top[0] - top[1]}"
            return i
        assert abs(a.logprobs[i][x].logprob - b.logprobs[i][y].logprob) <= LOGPROB_TOL, i
    return len(b.token_ids)


BASE = _tokens(1, 240)
TAIL = _tokens(2, 40)
CASES = {  # (the request that fills the cache, the request that hits, the tokens it should find cached)
    "the hit ends at a block boundary": (BASE[:200], BASE[:128] + TAIL[:30], 128),
    "the prompts diverge inside the second block": (BASE[:200], BASE[:170] + TAIL, 128),
    "the prompts diverge inside the first block": (BASE[:200], BASE[:100] + TAIL, 0),
    "a prompt equal to a cached one": (BASE[:200], BASE[:200], 128),
    "a cached prompt of one whole block keeps its last token to compute": (BASE[:128], BASE[:128], 0),
}


@pytest.mark.parametrize("case", CASES)
def test_a_hit_equals_the_same_request_computed_from_scratch(llm, case):
    seed, prompt, cached = CASES[case]
    want = _miss(llm, prompt)
    _generate(llm, [seed])
    (got,) = _generate(llm, [prompt])
    assert got.num_cached_tokens == cached
    assert _assert_same_run(got, want) >= 8


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_next_turn_hits_the_blocks_of_the_previous_output(llm, async_scheduling):
    """Generated tokens fill blocks too (snapshotted when a decode crosses a boundary): the next
    turn of a chat, the previous prompt + output + more, finds them."""
    llm.engine.async_scheduling = async_scheduling
    try:
        assert llm.reset_prefix_cache()
        (first,) = _generate(llm, [BASE[:100]], max_tokens=60)  # positions 0..159: crosses 128 while decoding
        turn = BASE[:100] + list(first.outputs[0].token_ids) + TAIL[:10]
        want = _miss(llm, turn)
        _generate(llm, [BASE[:100]], max_tokens=60)
        (got,) = _generate(llm, [turn])
        assert got.num_cached_tokens == BLOCK
        assert _assert_same_run(got, want) >= 8
    finally:
        llm.engine.async_scheduling = True


def test_evicted_blocks_and_snapshots_are_recomputed_exactly(llm):
    """Other prompts fill the pool and the snapshots: the cached prefix is evicted (least recently
    used first), and its next request computes it again, equal to a miss."""
    seed, prompt, _ = CASES["the hit ends at a block boundary"]
    want = _miss(llm, prompt)
    _generate(llm, [seed])
    scheduler = llm.engine.scheduler
    for k in range(6):  # 6 x (2 blocks, 1 snapshot) of other prefixes: more than the 6 blocks and 4 snapshots
        _generate(llm, [_tokens(100 + k, 200)], max_tokens=2)
    assert scheduler.block_managers[0].num_cached_blocks <= USABLE_BLOCKS
    (got,) = _generate(llm, [prompt])
    assert got.num_cached_tokens == 0
    assert _assert_same_run(got, want) >= 8
    scheduler.check_invariants()


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt(llm):
    """Cached positions would have no prompt logprobs (vLLM skips the cache for such requests)."""
    seed, prompt, cached = CASES["a prompt equal to a cached one"]
    assert llm.reset_prefix_cache()
    _generate(llm, [seed])
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, prompt_logprobs=1),
                          use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(prompt) and all(lp for lp in out.prompt_logprobs[1:])


def test_reset_is_refused_while_a_request_runs(llm):
    engine = llm.engine
    engine.add_request("busy", BASE[:20], SamplingParams(max_tokens=4))
    assert not llm.reset_prefix_cache()
    engine.abort("busy")
    while engine.has_unfinished():
        engine.step()
    assert llm.reset_prefix_cache()


def test_64_requests_from_a_prefix_tree_with_aborts_and_preemptions_leave_nothing_held(llm):
    """Random prompts from a tree of shared prefixes, random lengths, some aborted part-way,
    through a pool small enough to preempt: afterwards every block and snapshot is free or
    cached-and-evictable, every reference count zero; the hits and the counters agree; a sample
    of the requests equals their misses."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    assert llm.reset_prefix_cache()
    rng = np.random.default_rng(64)
    roots = [_tokens(200 + k, 200) for k in range(3)]
    prompts, params = {}, {}
    for i in range(64):
        root = roots[rng.integers(3)]
        keep = int(rng.integers(1, 200))
        prompts[f"r{i}"] = root[:keep] + _tokens(300 + i, int(rng.integers(1, 30)))
        params[f"r{i}"] = SamplingParams(max_tokens=int(rng.integers(1, min(80, 256 - len(prompts[f"r{i}"])))), temperature=0.0, logprobs=2,
                                         ignore_eos=True)
    queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
    preemptions = scheduler.num_preemptions
    finished, aborted, pending = {}, set(), list(prompts)
    while pending or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                rid = pending.pop(0)
                engine.add_request(rid, prompts[rid], params[rid])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        running = sorted(engine.unfinished_ids())
        if running and rng.random() < 0.015:
            rid = running[rng.integers(len(running))]
            engine.abort(rid)
            aborted.add(rid)
    assert scheduler.num_preemptions > preemptions
    scheduler.check_invariants()
    for bm in scheduler.block_managers:
        assert not any(bm._ref_counts) and bm.num_free_blocks == USABLE_BLOCKS and bm.num_free_slots == bm.num_seq_slots
    assert all(pool.num_reserved == 0 for pool in scheduler.snapshot_pools)
    done = [out for rid, out in finished.items() if rid not in aborted]
    assert len(done) >= 40 and all(out.outputs[0].finish_reason == "length" for out in done)
    cached = [out.num_cached_tokens for out in done]
    assert all(c % BLOCK == 0 and c < len(out.prompt_token_ids) for c, out in zip(cached, done))
    assert sum(c > 0 for c in cached) >= 10
    # The counters count every admission (a preempted request is looked up again): at least the
    # first admissions' figures.
    assert scheduler.prefix_cache_hits - hits >= sum(cached)
    assert scheduler.prefix_cache_queries - queries >= sum(len(out.prompt_token_ids) for out in done)
    for out in sorted((o for o in done if o.num_cached_tokens), key=lambda o: o.request_id)[:4]:
        want = _miss(llm, out.prompt_token_ids, params[out.request_id].max_tokens)
        assert want.outputs[0].finish_reason == "length"
        assert _assert_same_run(out, want) >= 1
