"""The engine end to end (`LLM` over `LLMEngine`): greedy tokens, logprobs and prompt logprobs
against the full forward, each request alone against a 64-request mix with aborts and forced
preemption, sampling options, errors, pool sizes and chat.

Two engines, module-scoped and shared by every test (compiles dominate CI):
* `llm`: the runner tests' config (vocabulary 512, every boundary within a few hundred tokens),
  float32 weights and a float32 KV cache (exact), 2 prefill + 1 decode buckets, 4 sequences of up
  to 256 tokens in blocks of 128. A block manager that hands out 4 of the pool's blocks
  (`conftest.capped_block_manager`) lets four short requests run but forces
  preemption when long ones (a second block each as they decode past 128) share the pool; one
  request alone always fits, so
  "alone" runs never preempt. `num_gpu_blocks_override=10` (the plan wants 12) is checked too.
* `chat_llm` (tests/conftest.py, shared with the server tests): a one-layer model with the real
  vocabulary (the V4 chat format's special tokens are ids above 128,000), 8 sequences.

Comparison rule: floats change slightly with the batch a request shares, so run A and run B are
compared at A's tokens: tokens must match wherever A's top-1/top-2 logprob gap exceeds 1e-3 (past
a near tie the runs may diverge and nothing after it is compared) and logprobs within 1e-4.
"""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest

from dsv4_jax import LLM, SamplingParams
from dsv4_jax.chat import (
    ASSISTANT,
    BOS,
    DSML,
    THINK_END,
    THINK_START,
    TOOLS_SECTION_HEAD,
    attach_request_fields,
    encode_messages,
)
from dsv4_jax.engine import engine as engine_module
from dsv4_jax.engine import runner as runner_module
from dsv4_jax.engine.compiles import CompileCounter
from dsv4_jax.engine.args import EngineArgs, default_buckets
from dsv4_jax.presets import get_config
from dsv4_jax.testing import write_random_checkpoint

from conftest import TINY_ENGINE_LAYERS, capped_block_manager, tiny_engine_args  # tests/ is on sys.path

CONFIG = get_config("dsv4-tiny-test").replace(**TINY_ENGINE_LAYERS)
VOCAB = CONFIG.vocab_size
EOS = CONFIG.eos_token_id
ENGINE_ARGS = tiny_engine_args()  # shared with tests/test_async_engine.py (conftest)
MAX_MODEL_LEN, SEQS, BLOCK = ENGINE_ARGS["max_model_len"], ENGINE_ARGS["max_num_seqs"], ENGINE_ARGS["block_size"]
BLOCKS_OVERRIDE = ENGINE_ARGS["num_gpu_blocks_override"]
USABLE_BLOCKS = 4
GAP = 1e-3  # top-1/top-2 logprob gap below which two runs may pick different tokens
LOGPROB_TOL = 1e-4
REFERENCE_SHAPE = (4, 64)  # every full-forward call uses this one shape: one compile


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("engine") / "ckpt", CONFIG, seed=3)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM.from_engine_args(EngineArgs(str(checkpoint), **ENGINE_ARGS),
                                block_manager_factory=capped_block_manager(USABLE_BLOCKS))


def _prompt(seed: int, length: int) -> list[int]:
    """BOS, then random ordinary tokens (ids 0-2 are BOS, EOS and padding)."""
    return [0, *np.random.default_rng(seed).integers(3, VOCAB, size=length - 1).tolist()]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _full_log_softmax(llm, sequences: list[list[int]]) -> list[np.ndarray]:
    """log_softmax of the full forward `model(ids)` at every position of each sequence. The
    forward is causal, so padding a sequence to REFERENCE_SHAPE leaves its own rows unchanged."""
    rows, length = REFERENCE_SHAPE
    out = []
    for first in range(0, len(sequences), rows):
        group = sequences[first : first + rows]
        ids = np.zeros(REFERENCE_SHAPE, np.int32)
        for i, seq in enumerate(group):
            assert len(seq) <= length, len(seq)
            ids[i, : len(seq)] = seq
        logits = np.asarray(llm.model(ids))
        out += [_log_softmax(logits[i, : len(seq)]) for i, seq in enumerate(group)]
    return out


def _top2_gap(entry) -> float:
    """The rank-1 minus rank-2 logprob of one position's logprobs dict (logprobs >= 2)."""
    by_rank = {lp.rank: lp.logprob for lp in entry.values() if lp.rank is not None}
    return by_rank[1] - by_rank[2]


def assert_same_under_gap_rule(a, b, *, greedy: bool) -> tuple[int, bool]:
    """Completion `b` against completion `a` (both with logprobs >= 2): equal tokens, except that
    greedy runs may part at a near tie of `a` (nothing after it is compared), and the sampled
    tokens' logprobs within LOGPROB_TOL. Returns (positions compared, whether they parted)."""
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        if ta != tb:
            assert greedy and _top2_gap(a.logprobs[i]) <= GAP, (i, a.token_ids, b.token_ids)
            return i, True
        assert abs(a.logprobs[i][ta].logprob - b.logprobs[i][tb].logprob) <= LOGPROB_TOL, i
    return min(len(a.token_ids), len(b.token_ids)), False


def _assert_idle(llm) -> None:
    """Every allocator back at its initial free count with all reference counts zero:
    `check_invariants` requires a free block to have count 0 and a held one to be listed by a
    holder, so all usable blocks free means no reference anywhere."""
    scheduler = llm.engine.scheduler
    assert not llm.engine.has_unfinished() and not scheduler.has_unfinished()
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0 and scheduler.kv_cache_usage == 0
    for bm in scheduler.block_managers:
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_compressed_blocks == USABLE_BLOCKS
        assert bm.num_free_slots == bm.num_seq_slots == SEQS


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def greedy_run(llm):
    """One prompt's greedy completion (12 tokens, top-3 logprobs), reused by the option tests."""
    prompt = _prompt(21, 9)
    (out,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3))
    completion = out.outputs[0]
    assert len(set(completion.token_ids)) >= 4, completion.token_ids  # not one token repeated
    return prompt, completion


# ---- 1. against the full forward -----------------------------------------------------------------
def test_greedy_tokens_logprobs_and_prompt_logprobs_follow_the_full_forward(llm):
    # Chunks of up to 32 tokens: 5 and 21 in one, 33 in 32 + a one-token tail, 45 in 32 + 13; run
    # together, so chunks of several requests and decodes share steps.
    prompts = [_prompt(s, n) for s, n in ((1, 5), (2, 21), (3, 33), (4, 45))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    counter = CompileCounter()
    outs = _generate(llm, prompts, params)
    assert counter.built == 0  # before the reference forward below

    def alone(token: int) -> str:
        return llm.tokenizer.decode([token], skip_special_tokens=False)

    references = _full_log_softmax(llm, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)])
    compared = 0
    for prompt, out, ref in zip(prompts, outs, references):
        completion = out.outputs[0]
        tokens = completion.token_ids
        assert len(tokens) == 10 and len(set(tokens)) >= 4, tokens
        assert completion.finish_reason == "length"
        for i, token in enumerate(tokens):
            row = ref[len(prompt) - 1 + i]
            top = np.sort(row)[::-1]
            if top[0] - top[1] > GAP:
                assert token == int(np.argmax(row)), (i, tokens)
                compared += 1
            entry = completion.logprobs[i]
            assert token in entry and len(entry) in (3, 4)  # top 3, plus the sampled token if outside
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t]) <= LOGPROB_TOL, (i, t)
                assert lp.decoded_token == alone(t), (i, t)  # vLLM's: the token's text on its own
        total = sum(entry[t].logprob for entry, t in zip(completion.logprobs, tokens))
        assert abs(completion.cumulative_logprob - total) < 1e-6
        # Prompt logprobs: None for the first token, then each token given the ones before it.
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for j in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[j], ref[j - 1]
            assert prompt[j] in entry
            assert entry[prompt[j]].rank == int((row > row[prompt[j]]).sum()) + 1
            best = np.argsort(-row)[:3]
            assert {t for t, lp in entry.items() if lp.rank is not None and lp.rank <= 3} == set(best.tolist())
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t]) <= LOGPROB_TOL, (j, t)
                assert lp.decoded_token == alone(t), (j, t)
    assert compared >= 36  # the rule skipped at most a few near ties
    _assert_idle(llm)


def test_prompt_logprobs_of_a_one_token_tail_chunk_compile_nothing(llm):
    """A 33-token prompt alone: its last token is a one-token chunk in a decode-only step."""
    prompt = _prompt(3, 33)
    counter = CompileCounter()
    (out,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    assert counter.built == 0
    assert len(out.prompt_logprobs) == 33 and all(e is not None for e in out.prompt_logprobs[1:])


# ---- 2. alone against a 64-request mix with aborts and preemption -------------------------------
def _mix_requests(rng: np.random.Generator) -> list[tuple[str, list[int], SamplingParams, str]]:
    """(id, prompt, params, kind): a third of the prompts long enough to need a second block as they
    decode (a prompt is admitted only when its own blocks are free, so growth is what preempts)."""
    requests = []
    for i in range(64):
        long = rng.random() < 0.35
        length = int(rng.integers(110, 128) if long else rng.integers(2, 40))
        max_tokens = int(rng.integers(20, 31) if long else rng.integers(6, 11))
        kind = ("greedy", "greedy", "seeded", "unseeded")[i % 4]
        if kind == "greedy":
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        else:
            params = SamplingParams(temperature=float(rng.uniform(0.6, 1.2)), top_k=int(rng.choice([0, 50])),
                                    top_p=float(rng.choice([1.0, 0.9])), max_tokens=max_tokens, logprobs=2,
                                    seed=1000 + i if kind == "seeded" else None)
        requests.append((f"mix-{i}", _prompt(100 + i, length), params, kind))
    return requests


def test_each_request_alone_equals_itself_inside_a_mix_with_aborts_and_preemption(llm, monkeypatch):
    engine, scheduler = llm.engine, llm.engine.scheduler
    rng = np.random.default_rng(7)
    requests = _mix_requests(rng)
    aborted_at = {rid: int(rng.integers(1, 80)) for rid, *_ in
                  [requests[i] for i in rng.choice(len(requests), size=8, replace=False)]}
    preempted: set[str] = set()
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        preempted.update(out.preempted)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    preemptions_before = scheduler.num_preemptions
    counter = CompileCounter()
    llm.engine.runner.compiles.reset()
    # The mix: half queued at once, the rest two per step; aborts at their step if still running.
    mixed, pending, step = {}, list(requests), 0
    for rid, prompt, params, _ in pending[:32]:
        engine.add_request(rid, prompt, params)
    pending = pending[32:]
    while engine.has_unfinished() or pending:
        for rid, prompt, params, _ in pending[:2]:
            engine.add_request(rid, prompt, params)
        pending = pending[2:]
        for out in engine.step():
            if out.finished:
                mixed[out.request_id] = out
        step += 1
        for rid, at in aborted_at.items():
            if at == step and rid not in mixed:
                out = engine.abort(rid)
                if out is not None:  # None: not added yet or already finished
                    assert out.outputs[0].finish_reason == "abort"
                    mixed[rid] = out
    assert counter.built == 0 and llm.engine.runner.compiles.built == 0
    assert scheduler.num_preemptions > preemptions_before and preempted
    _assert_idle(llm)
    # Each request alone (one request always fits: no preemption).
    preemptions_mixed = scheduler.num_preemptions
    checked = {"greedy": 0, "seeded": 0, "preempted": 0, "aborted": 0, "parted": 0}
    for rid, prompt, params, kind in requests:
        if kind == "unseeded":  # its random stream depends on the engine's step: not comparable
            continue
        (alone,) = _generate(llm, [prompt], params)
        a, b = alone.outputs[0], mixed[rid].outputs[0]
        if kind == "greedy":
            assert len(set(a.token_ids)) >= 4, a.token_ids
        n, parted = assert_same_under_gap_rule(a, b, greedy=kind == "greedy")
        if parted:
            checked["parted"] += 1
        elif b.finish_reason == "abort":
            assert n == len(b.token_ids) <= len(a.token_ids)  # what it had so far
            checked["aborted"] += 1
        else:
            assert b.finish_reason == a.finish_reason
            assert n == len(a.token_ids) == len(b.token_ids), (rid, a.token_ids, b.token_ids)
            checked[kind] += 1
            checked["preempted"] += rid in preempted
    assert scheduler.num_preemptions == preemptions_mixed
    assert checked["greedy"] >= 20 and checked["seeded"] >= 8 and checked["preempted"] >= 1, checked
    assert checked["parted"] <= 2, checked  # near ties are rare
    _assert_idle(llm)


# ---- 3. sampling options through the engine ------------------------------------------------------
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)


def test_a_seed_gives_the_same_tokens_alone_and_in_a_batch_and_n_children_use_seed_plus_i(llm, greedy_run):
    prompt, greedy = greedy_run
    (alone,) = _generate(llm, [prompt], SAMPLED)
    (next_seed,) = _generate(llm, [prompt], dataclasses.replace(SAMPLED, seed=1235))
    batch = _generate(llm, [_prompt(5, 30), prompt, _prompt(6, 3)],
                      [SamplingParams(temperature=0.0, max_tokens=5), SAMPLED, SamplingParams(temperature=1.0, seed=9)])
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert alone.outputs[0].token_ids != greedy.token_ids[:8]  # the seed sampled something
    assert alone.outputs[0].token_ids != next_seed.outputs[0].token_ids
    (pair,) = _generate(llm, [prompt], dataclasses.replace(SAMPLED, n=2))
    assert [c.index for c in pair.outputs] == [0, 1]
    assert [c.token_ids for c in pair.outputs] == [alone.outputs[0].token_ids, next_seed.outputs[0].token_ids]
    _assert_idle(llm)


def test_outputs_carry_the_engines_phase_timestamps(llm, greedy_run):
    """RequestOutput.metrics (vLLM's phases): arrival <= first scheduled <= first token <= last token,
    on one monotonic clock, within the call; the first scheduling not moved by later steps."""
    prompt, _ = greedy_run
    before = time.monotonic()
    outs = _generate(llm, [prompt, _prompt(41, 20)], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    after = time.monotonic()
    for out in outs:
        t = out.metrics
        assert before <= t.arrival_time <= t.first_scheduled_time <= t.first_token_time <= t.last_token_time <= after
        assert t.last_token_time > t.first_token_time  # six tokens, six steps
    streamed = []
    llm.engine.add_request("phases", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while llm.engine.has_unfinished():
        streamed += [o.metrics for o in llm.engine.step() if o.request_id == "phases"]
    assert len({m.first_scheduled_time for m in streamed}) == 1 and len({m.first_token_time for m in streamed}) == 1
    assert [m.last_token_time for m in streamed] == sorted({m.last_token_time for m in streamed})  # one per token


def test_max_tokens_and_stop_token_ids(llm, greedy_run):
    prompt, greedy = greedy_run
    (exact,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    assert exact.outputs[0].token_ids == greedy.token_ids[:7] and exact.outputs[0].finish_reason == "length"
    k = next(i for i in range(2, 12) if greedy.token_ids[i] not in greedy.token_ids[:i])
    stop = greedy.token_ids[k]
    (out,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]))
    c = out.outputs[0]
    assert c.token_ids == greedy.token_ids[: k + 1]  # the stop token is the last one, counted
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    # Its text is left out, unless include_stop_str_in_output (vLLM's detokenizer skips the token
    # that stopped the request).
    decode = llm.engine.tokenizer.decode
    assert c.text == decode(greedy.token_ids[:k]) != decode(greedy.token_ids[: k + 1])
    (kept,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop],
                                                      include_stop_str_in_output=True))
    assert kept.outputs[0].token_ids == c.token_ids and kept.outputs[0].text == decode(greedy.token_ids[: k + 1])
    # The stop token as the max_tokens-th token: still a stop, its text left out (vLLM >= 0.11.1
    # checks stop tokens before the length).
    (last,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=k + 1, stop_token_ids=[stop]))
    assert (last.outputs[0].token_ids, last.outputs[0].text) == (c.token_ids, c.text)
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", stop)
    (kept_last,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=k + 1, stop_token_ids=[stop],
                                                           include_stop_str_in_output=True))
    assert (kept_last.outputs[0].text, kept_last.outputs[0].finish_reason) == (kept.outputs[0].text, "stop")


def test_min_tokens_bans_stop_tokens_until_reached(llm, greedy_run):
    prompt, greedy = greedy_run
    stop = greedy.token_ids[1]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, stop_token_ids=[stop])
    counter = CompileCounter()
    (out,) = _generate(llm, [prompt], params)
    assert counter.built == 0  # a batch with bans and no penalties was warmed up too
    c = out.outputs[0]
    assert len(c.token_ids) >= 4 and stop not in c.token_ids[:4]
    # Position 1 sees the same prefix as the greedy run, with its best token banned: the second best.
    second, third = sorted((lp.rank, t, lp.logprob) for t, lp in greedy.logprobs[1].items() if lp.rank)[1:3]
    assert second[2] - third[2] > GAP
    assert c.token_ids[:2] == [greedy.token_ids[0], second[1]]
    if c.finish_reason == "stop":
        assert c.token_ids[-1] == stop and c.stop_reason == stop


def _unique_piece(text: str, start: int) -> tuple[int, str]:
    """A 2-character piece of `text` at or after `start` that occurs nowhere else in it."""
    for i in range(start, len(text) - 1):
        piece = text[i : i + 2]
        if "\ufffd" not in piece and text.find(piece) == i and text.find(piece, i + 1) < 0:
            return i, piece
    raise AssertionError(f"no unique piece in {text!r}")


def test_stop_strings_are_never_shown_and_wait_for_min_tokens(llm, greedy_run):
    prompt, greedy = greedy_run
    i, piece = _unique_piece(greedy.text, 3)
    (out,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=piece))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", piece)
    assert c.text == greedy.text[:i] and piece not in c.text
    assert c.token_ids == greedy.token_ids[: len(c.token_ids)] and len(c.token_ids) < 12
    # Completed by the max_tokens-th token: still a stop (vLLM reports the stop string then).
    (last,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=len(c.token_ids), stop=piece))
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason, last.outputs[0].text) == ("stop", piece, c.text)
    # A stop string completed before min_tokens does not count (vLLM checks the text after it).
    (short,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=len(c.token_ids), ignore_eos=True))
    (late,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=piece,
                                                      min_tokens=len(c.token_ids) + 1))
    assert piece in short.outputs[0].text
    assert late.outputs[0].token_ids == greedy.token_ids and late.outputs[0].text == greedy.text
    assert late.outputs[0].finish_reason == "length"


def test_streamed_text_never_shows_a_stop_string_that_a_later_token_completes(llm, greedy_run):
    """A stop string that starts in one token's text and ends in the next: after the first token
    its opening characters must wait (the server streams each output's new text and cannot take
    text back), so every output's text is a prefix of the final one."""
    prompt, greedy = greedy_run
    decode = llm.engine.tokenizer.decode
    texts = [decode(greedy.token_ids[:k]) for k in range(len(greedy.token_ids) + 1)]
    ends = [len(t) for t in texts]
    for k in range(2, len(ends) - 1):  # the first k tokens' text ends at ends[k], token k + 1's follows
        at = ends[k] - 1
        stop = greedy.text[at : at + 2]
        whole = greedy.text.startswith(texts[k + 1]) and "\ufffd" not in texts[k + 1]
        if whole and ends[k - 1] <= at < ends[k] < ends[k + 1] and greedy.text.find(stop) == at:
            break
    else:
        pytest.skip(f"no stop string straddling two tokens in {greedy.text!r}")
    llm.engine.add_request("straddle", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                              stop=[stop]))
    seen = []
    while llm.engine.has_unfinished():
        seen += [o.outputs[0] for o in llm.engine.step() if o.request_id == "straddle"]
    assert (seen[-1].text, seen[-1].finish_reason, seen[-1].stop_reason) == (greedy.text[:at], "stop", stop)
    assert len(seen) == k + 1  # the token that completed the stop string is its last
    assert all(seen[-1].text.startswith(c.text) for c in seen), [c.text for c in seen]


def test_eos_stops_unless_ignore_eos(llm, greedy_run):
    prompt, _ = greedy_run
    force_eos = {EOS: 100.0}
    (stopped,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=5, logit_bias=force_eos))
    (ignored,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=5, logit_bias=force_eos,
                                                         ignore_eos=True))
    assert stopped.outputs[0].token_ids == [EOS]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", None)
    assert ignored.outputs[0].token_ids == [EOS] * 5 and ignored.outputs[0].finish_reason == "length"
    # EOS as the max_tokens-th token is a stop too (vLLM checks it before the length).
    (last,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=1, logit_bias=force_eos))
    assert (last.outputs[0].token_ids, last.outputs[0].text, last.outputs[0].finish_reason) == ([EOS], "", "stop")
    # min_tokens bans EOS with ignore_eos too (vLLM: its stop-id set holds EOS whatever ignore_eos).
    (late,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=5, logit_bias=force_eos,
                                                      ignore_eos=True, min_tokens=3))
    assert EOS not in late.outputs[0].token_ids[:3] and late.outputs[0].token_ids[3:] == [EOS, EOS]


def test_async_scheduling_gives_the_synchronous_outputs(llm, greedy_run, monkeypatch):
    """The next step is scheduled and launched before this one's tokens reach the host: outputs
    equal one-step-at-a-time's (greedy under the comparison rule, seeded exactly), max_tokens is
    exact, and a token sampled after a request stopped is dropped."""
    prompt, free = greedy_run
    stop_at = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])
    prompts = [prompt, _prompt(31, 5), _prompt(32, 40), _prompt(33, 17), _prompt(7, 9), _prompt(34, 6), prompt]
    penalties = dict(repetition_penalty=1.5, frequency_penalty=0.6, presence_penalty=0.4)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2,
                             stop_token_ids=[free.token_ids[stop_at]]),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2),
              # Penalised rows read their pending token on the device while steps overlap.
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, **penalties),
              SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True, logprobs=2, **penalties),
              # The stop token as the max_tokens-th token: "stop", also when the next step was launched.
              SamplingParams(temperature=0.0, max_tokens=stop_at + 1, ignore_eos=True, logprobs=2,
                             stop_token_ids=[free.token_ids[stop_at]])]
    taken = []
    take = llm.engine.scheduler._take_as_done
    monkeypatch.setattr(llm.engine.scheduler, "_take_as_done", lambda output: (taken.append(1), take(output)))
    runs = {}
    for mode in (False, True):
        monkeypatch.setattr(llm.engine, "async_scheduling", mode)
        taken.clear()
        runs[mode] = [o.outputs[0] for o in _generate(llm, prompts, params)]
        assert bool(taken) == mode  # steps overlapped only in async mode
        _assert_idle(llm)
    sync, overlapped = runs[False], runs[True]
    for a, b, p in zip(sync, overlapped, params):
        assert_same_under_gap_rule(a, b, greedy=p.temperature == 0)
        assert (b.finish_reason, len(b.token_ids)) == (a.finish_reason, len(a.token_ids))
    # The stop token ends the first request exactly there; the others run to max_tokens (the last
    # one's max_tokens-th token is that stop token).
    assert overlapped[0].token_ids == free.token_ids[: stop_at + 1] and overlapped[0].finish_reason == "stop"
    assert [len(c.token_ids) for c in overlapped[1:-1]] == [12, 9, 7, 12, 10]
    assert (overlapped[-1].token_ids, overlapped[-1].finish_reason) == (overlapped[0].token_ids, "stop")


def test_each_streamed_output_keeps_the_tokens_it_had(llm, greedy_run):
    """Outputs before the last share the request's growing list as O(1) snapshots: each must still
    show exactly the tokens it was made with once later ones are appended; the last is a list."""
    prompt, free = greedy_run
    llm.engine.add_request("stream", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    seen = []
    while llm.engine.has_unfinished():
        seen += [o for o in llm.engine.step() if o.request_id == "stream"]
    final = seen[-1].outputs[0].token_ids
    assert type(final) is list and final == free.token_ids[:6]
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3, 4, 5, 6]
    for o in seen:
        ids, n = o.outputs[0].token_ids, len(o.outputs[0].token_ids)
        assert ids == final[:n] and list(ids) == final[:n] and ids[-1] == final[n - 1]
        assert ids[1:] == final[1:n] and list(reversed(ids)) == final[:n][::-1]
        with pytest.raises(IndexError):
            ids[n]
    assert all(o.prompt_token_ids is seen[0].prompt_token_ids == prompt for o in seen)  # one copy
    _assert_idle(llm)


def test_an_interrupted_generate_leaves_the_engine_serving(llm, greedy_run, monkeypatch):
    """Ctrl-C in a notebook lands anywhere in a step: here while a step's tokens are fetched (with
    the next step launched: async scheduling), then right after a step call consumed the cache it
    was donated; last, a cache that cannot be read. Each time the next generate must run as on a
    fresh engine."""
    prompt, greedy = greedy_run
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    real_get, fetches = engine_module.jax.device_get, []

    def interrupted_get(x):
        fetches.append(1)
        if len(fetches) == 3:
            raise KeyboardInterrupt
        return real_get(x)

    monkeypatch.setattr(engine_module.jax, "device_get", interrupted_get)
    with pytest.raises(KeyboardInterrupt):
        _generate(llm, [prompt, _prompt(5, 7)], params)
    monkeypatch.undo()
    (again,) = _generate(llm, [prompt], params)
    assert again.outputs[0].token_ids == greedy.token_ids
    _assert_idle(llm)

    def step_then_interrupt(real_step):
        def call(*args):
            real_step(*args)  # the cache argument is donated: gone, and its successor is dropped
            raise KeyboardInterrupt
        return call

    steps = llm.engine.runner._steps  # the warmed-up executables, by bucket
    monkeypatch.setattr(llm.engine.runner, "_steps", {b: step_then_interrupt(f) for b, f in steps.items()})
    with pytest.raises(KeyboardInterrupt):
        _generate(llm, [prompt], params)
    monkeypatch.undo()
    (after,) = _generate(llm, [prompt], params)
    assert after.outputs[0].token_ids == greedy.token_ids
    _assert_idle(llm)

    # A GPU reports a failed step's error when its outputs are read, so the cache it returned
    # looks alive but cannot be read: reset() allocates it again, and the padding step passes.
    broken_cache = llm.engine.runner.cache

    def unreadable(x):
        raise RuntimeError("an asynchronous device error")

    monkeypatch.setattr(runner_module.jax, "block_until_ready", unreadable)
    llm.engine.reset()
    monkeypatch.undo()
    assert llm.engine.runner.cache is not broken_cache
    llm.engine.probe()
    (after,) = _generate(llm, [prompt], params)
    assert after.outputs[0].token_ids == greedy.token_ids
    _assert_idle(llm)


def test_a_request_id_reused_while_its_old_steps_run_takes_nothing_from_them(llm):
    """Abort a request while its steps are launched, then add another under the same id: those
    steps' rows belong to the old request (its prompt), not to the new one."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    old_prompt, new_prompt = _prompt(1, 20), _prompt(2, 9)
    (expected,) = _generate(llm, [new_prompt], params)
    engine = llm.engine
    engine.add_request("reused", old_prompt, params)
    launched = engine.begin_step()  # its prefill, and (async scheduling) its first decode after it
    engine.abort("reused")
    engine.add_request("reused", new_prompt, params)
    outputs = engine.finish_step(launched)
    while engine.has_unfinished():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and final.prompt_token_ids == new_prompt
    assert len(final.prompt_logprobs) == len(new_prompt)
    assert [e and sorted(e) for e in final.prompt_logprobs] == [e and sorted(e) for e in expected.prompt_logprobs]
    assert final.outputs[0].token_ids == expected.outputs[0].token_ids
    _assert_idle(llm)


def test_requests_that_can_never_run_are_refused_with_the_numbers(llm):
    with pytest.raises(ValueError, match=r"prompt \(250 tokens\) plus max_tokens \(10\) exceeds max_model_len \(256\)"):
        _generate(llm, [[3] * 250], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\).*\[{VOCAB}, 9999\]"):
        _generate(llm, [[3, VOCAB, 9999]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=rf"stop_token_ids has token ids \[{VOCAB}\]"):
        _generate(llm, [[3, 4]], SamplingParams(max_tokens=2, stop_token_ids=[VOCAB]))
    # A prompt that leaves nothing is the prompt's fault whatever max_tokens says; without
    # max_tokens the client asked for what is left, and min_tokens beyond it cannot be met (vLLM: 400).
    for max_tokens in (None, 10):
        with pytest.raises(ValueError, match=r"prompt \(256 tokens\) leaves no room .* max_model_len \(256\)") as error:
            _generate(llm, [[3] * 256], SamplingParams(max_tokens=max_tokens))
        assert error.value.param == "prompt"
    # Ids that are not integers are refused, not rounded or parsed (numpy integers are integers).
    for bad in (4.7, "12", True):
        with pytest.raises(ValueError, match=rf"prompt token ids must be integers; got {re.escape(repr(bad))}"):
            _generate(llm, [[3, bad]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"min_tokens \(7\) exceeds the 6 tokens") as error:
        _generate(llm, [[3] * 250], SamplingParams(max_tokens=None, min_tokens=7))
    assert error.value.param == "min_tokens"
    # A refusal in the middle of a batch leaves nothing queued.
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        _generate(llm, [[3, 4], [3] * 250], SamplingParams(max_tokens=10))
    # More stop ids and EOS than a step can ban below min_tokens (SamplerConfig.max_banned_ids):
    # refused up front, not failing the step of every request.
    stops = list(range(3, 73))
    with pytest.raises(ValueError, match=rf"at most 64 stop_token_ids and EOS ids .* names {len({*stops, EOS})}"):
        _generate(llm, [[3, 4], [3, 5]], SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=stops))
    _assert_idle(llm)


def test_penalties_follow_the_full_forwards_logits_under_vllms_rules(llm, monkeypatch):
    """Greedy with repetition, frequency and presence penalties: each token is the argmax of the
    full forward's logits after the penalties over the prompt and the tokens before it. The
    engine keeps each request's history, catches it up step by step, and with async scheduling
    the row's last token is still being sampled when its next batch is built: the device reads it."""
    prompt = _prompt(7, 9)  # its plain greedy completion repeats a prompt token, then its own
    plain = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    counter = CompileCounter()
    (greedy,) = _generate(llm, [prompt], SamplingParams(**plain))
    pending = []
    build = engine_module.build_sampling_batch
    monkeypatch.setattr(engine_module, "build_sampling_batch", lambda *a, **k: (
        batch := build(*a, **k), pending.append(batch.penalties is not None and (batch.penalties.pending_rows >= 0).any()))[0])
    monkeypatch.setattr(llm.engine, "async_scheduling", True)
    (out,) = _generate(llm, [prompt], SamplingParams(**plain, repetition_penalty=1.5, frequency_penalty=0.6,
                                                     presence_penalty=0.4))
    assert counter.built == 0  # penalised batches were warmed up
    assert sum(pending) >= 8, pending  # most decode steps read their penalised row's token on the device
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 12 and tokens != greedy.outputs[0].token_ids  # the penalties bite
    ids = np.zeros(REFERENCE_SHAPE, np.int32)
    ids[0, : len(prompt) + len(tokens)] = prompt + tokens
    logits = np.asarray(llm.model(ids))[0].astype(np.float64)
    compared = 0
    for k, token in enumerate(tokens):
        x = logits[len(prompt) - 1 + k].copy()
        seen = prompt + tokens[:k]
        x[seen] = np.where(x[seen] > 0, x[seen] / 1.5, x[seen] * 1.5)
        counts = np.bincount(np.asarray(tokens[:k], int), minlength=len(x))
        x -= 0.6 * counts + 0.4 * (counts > 0)
        top2 = np.sort(x)[-2:]
        if top2[1] - top2[0] <= GAP:
            break
        assert token == int(np.argmax(x)), (k, tokens)
        compared += 1
    assert compared >= 6, compared


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "float16"}, "dtype"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_model_len": -1}, "max_model_len"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"data_parallel_size": -1}, "data_parallel_size"),
    ({"enable_expert_parallel": "yes"}, "enable_expert_parallel"),
    ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"block_size": 0}, "block_size"),
    ({"seed": 1.5}, "seed"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ({"num_prefix_snapshots": 0}, "num_prefix_snapshots"),
    ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
])
def test_bad_llm_arguments_fail_before_anything_is_loaded(tmp_path, kwargs, field):
    # The model directory does not exist: an argument checked after loading would fail on it instead.
    with pytest.raises(ValueError, match=field) as error:
        LLM(str(tmp_path / "missing"), **kwargs)
    assert repr(next(iter(kwargs.values()))) in str(error.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_model_len": 4096}, rf"max_model_len \(4096\).*max_position_embeddings \({CONFIG.max_position_embeddings}\)"),
    ({"block_size": 100, "max_model_len": 256}, "block-size 100 must be a multiple of 128"),
    ({"kv_cache_dtype": "float16", "max_model_len": 256}, "float16"),
])
def test_arguments_that_need_the_config_fail_before_the_weights_load(checkpoint, monkeypatch, kwargs, message):
    from dsv4_jax.weights import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("load_model was called")

    monkeypatch.setattr(loading, "load_model", no_loading)
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoint), **kwargs)


def test_max_model_len_defaults_to_the_models_positions_at_most_4096(checkpoint, tmp_path, monkeypatch):
    """Without max_model_len, LLM and `python -m serve` take the model's max_position_embeddings,
    capped at 4096: the built-in dsv4-tiny (1024 positions) starts with every default. Resolved
    with the other defaults before any weights load."""
    import json

    from dsv4_jax.weights import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("load_model was called")

    monkeypatch.setattr(loading, "load_model", no_loading)
    assert CONFIG.max_position_embeddings < 4096
    config = EngineArgs(str(checkpoint)).create_engine_config()
    assert config.model_dir == checkpoint and config.max_model_len == CONFIG.max_position_embeddings
    assert EngineArgs(str(checkpoint), max_model_len=300).create_engine_config().max_model_len == 300
    long = tmp_path / "long"
    long.mkdir()
    raw = json.loads((checkpoint / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 1048576}))
    assert EngineArgs(str(long)).create_engine_config().max_model_len == 4096


def test_default_buckets_prefill_short_prompts_together_in_short_rows():
    """The default prefill buckets: a long prompt alone in one row of a chunk, long chunks of
    several prompts in budget-many rows, and short prompts together in rows of an eighth of a
    chunk, so that eight short prompts are not padded to eight full chunks."""
    buckets = default_buckets(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=None)
    assert buckets.pick(8, 20) == (8, 32)  # eight 20-token prompts: 256 token slots, not 2048
    assert buckets.pick(5, 32) == (8, 32)
    assert buckets.pick(1, 200) == (1, 256)
    assert buckets.pick(2, 33) == (8, 256)
    assert buckets.pick(8, 1) == (8, 1)  # decodes alone: a decode bucket
    # the token budget bounds every prefill bucket; tiny limits add no short bucket
    budgeted = default_buckets(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=512)
    assert set(budgeted.prefill) == {(1, 256), (2, 256), (2, 32)}
    assert default_buckets(max_num_seqs=4, max_model_len=16, max_num_batched_tokens=None).prefill == ((1, 16), (4, 16))
    # a budget below the chunk length shortens the chunk (a longer bucket could never be filled)
    assert default_buckets(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=16).prefill == ((1, 16),)


# ---- 4. pool sizes ---------------------------------------------------------------------------------
def _compressed_bytes_per_block(plan) -> int:
    return sum(plan.pool(name).bytes_per_block for name in ("csa", "indexer", "hca"))


def test_pools_have_the_planners_bytes_and_the_overridden_block_count(llm, chat_llm):
    # Without an override the pools hold exactly the planner's budget (tables and counters aside).
    plan = chat_llm.plan
    assert abs(chat_llm.cache_bytes - plan.kv_budget_bytes) <= 0.01 * plan.kv_budget_bytes
    assert chat_llm.layout.num_compressed_blocks == plan.num_blocks["compressed"]
    # With one the compressed pools change by whole blocks of the planner's size, nothing else.
    plan = llm.plan
    assert plan.num_blocks["compressed"] == SEQS * MAX_MODEL_LEN // BLOCK + SEQS != BLOCKS_OVERRIDE
    assert llm.layout.num_compressed_blocks == BLOCKS_OVERRIDE
    assert llm.engine.scheduler.config.num_compressed_blocks == BLOCKS_OVERRIDE  # the pool (its allocator hands out fewer)
    extra_blocks = BLOCKS_OVERRIDE - plan.num_blocks["compressed"]
    expected = plan.kv_budget_bytes + extra_blocks * _compressed_bytes_per_block(plan)
    assert abs(llm.cache_bytes - expected) <= 0.01 * expected
    assert llm.engine.runner.cache.compressed.hca.rows.shape[1] == BLOCKS_OVERRIDE


# ---- 5. chat ---------------------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}}]


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_builds_the_v4_prompt_and_parses_the_completion(chat_llm, thinking):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = chat_llm.chat(messages, params, use_tqdm=False, tools=TOOLS, chat_template_kwargs={"thinking": thinking})
    mode = "thinking" if thinking else "chat"
    # The prompt is the V4 encoder's, tools included, tokenized with one BOS and no other additions.
    assert out.prompt == encode_messages(attach_request_fields(messages, TOOLS), thinking_mode=mode)
    assert out.prompt.startswith(BOS) and TOOLS_SECTION_HEAD in out.prompt
    assert out.prompt.endswith(ASSISTANT + (THINK_START if thinking else THINK_END))
    tok = chat_llm.tokenizer
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False).ids
    assert out.prompt_token_ids[0] == tok.token_to_id(BOS) and out.prompt_token_ids.count(tok.token_to_id(BOS)) == 1
    completion = out.outputs[0]
    assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
    # The random model writes no chat markup: in chat mode all of it is content, in thinking mode
    # (the prompt opened <think>) all of it is reasoning; no tool calls either way.
    raw = tok.decode(completion.token_ids, skip_special_tokens=False)
    assert THINK_END not in raw and DSML not in raw, raw
    assert completion.tool_calls is None
    # As in vLLM, `text` is all of it, as generate gives it (special tokens skipped); the parse of
    # that text comes beside it.
    plain = tok.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.text == plain
    if thinking:
        assert (completion.reasoning, completion.content) == (plain, "")
    else:
        assert (completion.content, completion.reasoning) == (plain, None)


def test_chat_is_generate_on_the_v4_prompt_then_a_parse_of_its_text(chat_llm):
    """Stop strings, stop tokens and skip_special_tokens act on chat as on generate (the same
    text), and the reasoning / content parse splits exactly that text."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (first,) = chat_llm.chat(messages, base, use_tqdm=False)
    whole = first.outputs[0]
    assert len(whole.text) >= 8, whole.text
    stop_text = whole.text[4:7]
    for params in (dataclasses.replace(base, stop=[stop_text]),
                   dataclasses.replace(base, stop_token_ids=[whole.token_ids[5]]),
                   dataclasses.replace(base, skip_special_tokens=False)):
        (chat,) = chat_llm.chat(messages, params, use_tqdm=False)
        (plain,) = chat_llm.generate({"prompt_token_ids": chat.prompt_token_ids}, params, use_tqdm=False)
        got, expected = chat.outputs[0], plain.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            expected.text, expected.token_ids, expected.finish_reason, expected.stop_reason)
        # thinking mode (the default): the random model writes no </think>, so all is reasoning
        assert (got.reasoning, got.content, got.tool_calls) == (got.text, "", None)
    assert stop_text not in chat_llm.chat(messages, dataclasses.replace(base, stop=[stop_text]),
                                          use_tqdm=False)[0].outputs[0].text


def test_generate_takes_vllms_prompt_forms_and_closes_its_bar(chat_llm):
    tok = chat_llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=1)
    hello = [tok.token_to_id(BOS), *tok.encode("Hello", add_special_tokens=False).ids]
    by_text, by_dict, by_ids = chat_llm.generate(
        ["Hello", {"prompt": "Hello"}, {"prompt": "Hi", "prompt_token_ids": np.array(hello)}], params, use_tqdm=False)
    assert (by_text.prompt, by_dict.prompt, by_ids.prompt) == ("Hello", "Hello", "Hi")  # a TokensPrompt's text as given
    assert by_text.prompt_token_ids == by_dict.prompt_token_ids == by_ids.prompt_token_ids == hello
    assert {type(t) for t in by_ids.prompt_token_ids} == {int}  # numpy ids come back as Python ints
    for bad in ({"prompt": 3}, {"text": "Hello"}, 3):
        with pytest.raises(ValueError, match=r"prompts\[0\] must be a string, \{'prompt': str\}"):
            chat_llm.generate([bad], params, use_tqdm=False)

    bars = []

    class Bar:  # a tqdm stand-in (vLLM's use_tqdm may be a tqdm class)
        def __init__(self, total, **kwargs):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n):
            self.n += n

        def set_postfix_str(self, text):
            pass

        def close(self):
            self.closed = True

    chat_llm.generate(["Hello", "Bye"], dataclasses.replace(params, n=2, seed=1, temperature=1.0), use_tqdm=Bar)
    assert (bars[-1].total, bars[-1].n, bars[-1].closed) == (4, 4, True)  # completions, as vLLM's bar
    # A step that raises (Ctrl-C in a notebook) closes the bar and leaves the engine as new.
    def interrupted():
        raise KeyboardInterrupt

    chat_llm.engine.step = interrupted  # an instance attribute shadows the method
    try:
        with pytest.raises(KeyboardInterrupt):
            chat_llm.generate(["Hello"], params, use_tqdm=Bar)
    finally:
        del chat_llm.engine.step
    assert bars[-1].closed and not chat_llm.engine.has_unfinished()


def test_without_sampling_params_generate_takes_the_generation_config_capped_to_the_room(chat_llm, monkeypatch):
    """vLLM's get_default_sampling_params: the model's generation_config.json values; a default
    max_tokens the prompt leaves no room for is capped, not refused (the caller asked for none)."""
    assert chat_llm.get_default_sampling_params() == SamplingParams()  # the test model has no file
    seen = []
    add = chat_llm.engine.add_request

    def spy(request_id, prompt_token_ids, params, **kwargs):
        seen.append(params)
        add(request_id, prompt_token_ids, params, **kwargs)

    monkeypatch.setattr(chat_llm.engine, "add_request", spy)
    defaults = {"temperature": 0.0, "max_tokens": 4}  # as generation_config.json would give them
    monkeypatch.setattr(chat_llm, "engine_config", dataclasses.replace(chat_llm.engine_config, sampling_defaults=defaults))
    long_prompt = [0, *range(5, 5 + chat_llm.engine.max_model_len - 4)]  # leaves 3 tokens
    outs = chat_llm.generate([{"prompt_token_ids": [0, 5, 6]}, {"prompt_token_ids": long_prompt}], use_tqdm=False)
    assert [(p.temperature, p.max_tokens) for p in seen] == [(0.0, 4), (0.0, None)]  # None: what is left
    assert [len(o.outputs[0].token_ids) <= n for o, n in zip(outs, (4, 3))] == [True, True]
    assert outs[1].outputs[0].finish_reason == "length" or outs[1].outputs[0].token_ids[-1] == CONFIG.eos_token_id


def test_get_tokenizer_encodes_and_templates_as_the_engine_does(chat_llm):
    tok = chat_llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    (out,) = chat_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS,
                           chat_template_kwargs={"thinking": False})
    assert tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, thinking=False) == out.prompt
    assert tok.apply_chat_template(messages, tools=TOOLS, thinking=False) == out.prompt_token_ids
    (hello,) = chat_llm.generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)
    assert tok.encode("Hello") == hello.prompt_token_ids and tok.decode(tok.encode("Hello")) == BOS + "Hello"
    assert (tok.bos_token_id, tok.eos_token_id) == (hello.prompt_token_ids[0], CONFIG.eos_token_id)


def test_snapshots_asked_for_with_prefix_caching_off_are_refused_naming_both(tmp_path):
    with pytest.raises(ValueError, match="num-prefix-snapshots.*no-enable-prefix-caching"):
        LLM(str(tmp_path / "missing"), enable_prefix_caching=False, num_prefix_snapshots=4)
