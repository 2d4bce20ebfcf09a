"""Speculative decoding (engine/speculative.py) on the paged cache and through the engine.

One config crosses every boundary within a hundred tokens: sliding window 4, CSA ratio 4 with
index_topk 2, HCA ratio 16, blocks of 128 positions; float32 cache, so nothing is rounded. One
`LLM` with k = 3 serves every test (its runner also runs the runner-level test first, speculative
rows in slots 0 and 1, plain decoding in slots 2 and 3).

* On the runner: verify rows whose drafts are accepted or rejected at every position leave the
  cache as a non-speculative run leaves it, and the logits at accepted positions are the full
  forward's; the MTP drafts are the whole-sequence MTP's argmax.
* Through the engine: host drafters that propose a previous run's tokens (every draft kept), or
  wrong ones (every draft rejected), or right ones up to a position that moves (rejections at
  every position), fewer than k, and the MTP block: greedy and seeded outputs, logprobs, stops,
  max_tokens, prefix-cache hits and n > 1 are what decoding without drafts gives.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dsv4_jax import LLM, SamplingParams
from dsv4_jax.engine.compiles import CompileCounter
from dsv4_jax.engine.runner import StepBuckets, StepRow
from dsv4_jax.presets import get_config
from dsv4_jax.testing import ReplayDrafter, paged_layout, write_random_checkpoint

CONFIG = get_config("dsv4-tiny-test").replace(sliding_window=4, compress_ratios=(0, 4, 16, 4, 0), index_topk=2)
K = 3  # drafts per verify row
PROMPT = 16
LENGTH = 88  # positions 0..87: windows of 4 and 16 completed many times, by accepted and rejected drafts
EXACT = 1e-5  # float32 cache: max |cached - full| / max |full|


GAP = 1e-3  # the comparison rule's top-1 / top-2 logit gap


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    assert CONFIG.num_nextn_predict_layers == 1
    return write_random_checkpoint(tmp_path_factory.mktemp("spec") / "ckpt", CONFIG, seed=11)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), dtype="float32", kv_cache_dtype="float32", max_model_len=256, max_num_seqs=4,
               block_size=128, buckets=StepBuckets(prefill=((2, 16),), decode=(2,)), seed=0,
               speculative_config={"method": "mtp", "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def model(llm):
    return llm.model


def _layout():
    return paged_layout(CONFIG, "float32", slots=4, max_model_len=256, num_mtp_layers=1, spare_compressor_windows=1)


def _readable(cache, layout, slot: int, blocks: list[int], position: int) -> dict[str, np.ndarray]:
    """What a step at `position` (the next token's) may read of `slot`'s cache: the main layers'
    ring rows of the window before it, the compressed entries and indexer keys before it, and the compressor
    rows its windows still need (CSA: the previous window and the current one so far; HCA: the
    current one so far), in the ring layout of model/cache_step.py."""
    host = jax.tree.map(np.asarray, cache)
    ring, bs = layout.sliding_ring, layout.block_size
    out = {}
    (sliding,) = jax.tree.leaves(host.sliding.kv)
    main = [i for i, layer in enumerate(layout.sliding_layers) if layer < CONFIG.num_hidden_layers]
    sliding = sliding[main]  # the MTP layer's window is the drafter's (checked through its drafts)
    for t in range(max(0, position - layout.window + 1), position):
        out[f"sliding {t}"] = sliding[:, slot * ring + (t // bs) % ring, t % bs]
    for name, ratio in (("csa", layout.csa_ratio), ("indexer", layout.csa_ratio), ("hca", layout.hca_ratio)):
        (pool,) = jax.tree.leaves(getattr(host.compressed, name))
        per_block = bs // ratio
        for j in range(position // ratio):
            out[f"{name} entry {j}"] = pool[:, blocks[j // per_block], j % per_block]
    for name, ratio, previous in (("csa_state", layout.csa_ratio, 1), ("csa_indexer_state", layout.csa_ratio, 1),
                                  ("hca_state", layout.hca_ratio, 0)):
        state = getattr(host, name)
        windows = state.kv.shape[2] // ratio
        for t in range(max(0, (position // ratio - previous) * ratio), position):
            row = (t // ratio % windows) * ratio + t % ratio
            out[f"{name} row {t}"] = np.stack([state.kv[:, slot, row], state.score[:, slot, row]])
    return out


def test_verify_steps_with_rejections_at_every_draft_equal_a_non_speculative_run(llm, model):
    """Two sequences side by side: prompt chunks, then verify rows of a token and K drafts whose
    first a are right (a = 0..K in turn, offset per sequence). After every step the accepted
    positions' logits equal the full forward's, and each slot's readable cache equals that of the
    same sequence decoded one token at a time in another slot (the same runner's plain decode
    steps); the MTP drafts of the step (greedy) are the whole-sequence MTP's argmax at the last
    accepted position wherever its top two differ."""
    layout = _layout()
    spec = llm.engine.runner  # the engine's own (nothing runs on it meanwhile); its cache is reset after
    assert spec.layout == layout and spec.num_speculative_tokens == K and spec.mtp_drafts
    rng = np.random.default_rng(3)
    ids = rng.integers(0, CONFIG.vocab_size, size=(2, LENGTH + K + 1))
    streams = model.hidden_streams(ids)  # the full forward's
    full = np.asarray(spec.head(streams))  # [2, T, vocab]: the full forward's logits
    mtp = np.asarray(model.mtp_logits(streams[:, :-1], ids[:, 1:]))  # [2, T - 1, vocab]
    assert spec.buckets.verify == ((2, K + 1),)
    blocks, plain_slots, plain_blocks = [[0, 2], [1, 3]], [2, 3], [[4, 6], [5, 7]]
    errors, compared, drafts_checked = [], 0, 0

    # The prompts but their last tokens, one chunk each: both runners alike; the drafter fills the
    # MTP layer's window at every step's positions (the prompt's too).
    prompts = [StepRow(i, 0, ids[i, : PROMPT - 1].tolist(), blocks[i]) for i in range(2)]
    spec.step([StepRow(plain_slots[i], 0, ids[i, : PROMPT - 1].tolist(), plain_blocks[i]) for i in range(2)])
    bucket, tokens, seqs = spec.build(prompts)
    out = spec.run(bucket, tokens, seqs, 2)
    next_ids = np.zeros(out.bucket, np.int32)
    next_ids[:2, : PROMPT - 1] = ids[:, 1:PROMPT]
    spec.draft(out.streams, seqs, next_ids, np.full(out.bucket[0], PROMPT - 2, np.int32))
    # Each sequence's next position, whose token is not in the cache yet (the same for `plain`).
    position, plain_at, step = [PROMPT - 1] * 2, [PROMPT - 1] * 2, 0
    while min(position) < LENGTH - 1:
        accepted = [(step + i) % (K + 1) for i in range(2)]
        rows = []
        for i in range(2):
            p, a = position[i], accepted[i]
            wrong = (ids[i, p + 1 + a : p + 1 + K] + 1 + rng.integers(0, CONFIG.vocab_size - 1, K - a)) % CONFIG.vocab_size
            rows.append(StepRow(i, p, [int(ids[i, p]), *ids[i, p + 1 : p + 1 + a].tolist(), *wrong.tolist()], blocks[i]))
        bucket, tokens, seqs = spec.build(rows)
        out = spec.run(bucket, tokens, seqs, len(rows))
        logits = np.asarray(out.logits).reshape(out.bucket[0], K + 1, -1)
        next_ids, draft_at = np.zeros(out.bucket, np.int32), np.zeros(out.bucket[0], np.int32)
        for i in range(2):
            p, a = position[i], accepted[i]
            got = logits[i, : a + 1]  # the row's K + 1 positions p..p+K; p..p+a are valid
            errors.append(np.abs(got - full[i, p : p + a + 1]).max() / np.abs(full[i, p : p + a + 1]).max())
            compared += a + 1
            next_ids[i, : a + 1] = ids[i, p + 1 : p + a + 2]  # the accepted drafts, then the "sampled" token
            draft_at[i] = a
        drafts = np.asarray(spec.draft(out.streams, seqs, next_ids, draft_at))
        for i in range(2):
            q = position[i] + accepted[i]
            top2 = np.sort(mtp[i, q])[-2:]
            if top2[1] - top2[0] > 1e-3:
                assert drafts[i, 0] == int(np.argmax(mtp[i, q])), (step, i)
                drafts_checked += 1
            position[i] = q + 1
        # Plain decoding of the same tokens, one at a time, up to where each sequence stands.
        while behind := [i for i in range(2) if plain_at[i] < position[i]]:
            spec.step([StepRow(plain_slots[i], plain_at[i], [int(ids[i, plain_at[i]])], plain_blocks[i])
                       for i in behind])
            for i in behind:
                plain_at[i] += 1
        step += 1
        for i in range(2):
            want = _readable(spec.cache, layout, plain_slots[i], plain_blocks[i], position[i])
            got = _readable(spec.cache, layout, i, blocks[i], position[i])
            assert want.keys() == got.keys()
            for name in want:
                scale = max(np.abs(np.nan_to_num(want[name], neginf=0)).max(), 1.0)
                np.testing.assert_allclose(got[name], want[name], atol=EXACT * scale, rtol=0,
                                           err_msg=f"step {step}, sequence {i}: {name}")
    assert max(errors) <= EXACT and compared >= 100 and drafts_checked >= 20, (max(errors), compared, drafts_checked)
    assert llm.reset_prefix_cache()  # nothing the engine cached may name blocks this test wrote


# ---- through the engine ----------------------------------------------------------------------------
PROMPTS = [np.random.default_rng(0).integers(0, CONFIG.vocab_size, size=n).tolist() for n in (20, 37, 9)]
NO_DRAFTS = ReplayDrafter({}, CONFIG.vocab_size)  # proposes nothing: every row decodes one token


def _generate(llm, drafter, params, prompts=PROMPTS):
    """Outputs with `drafter` (None: the MTP block) and the spec-decode counters it added."""
    engine = llm.engine
    engine.drafter = drafter
    stats = engine.spec_decode_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_position))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    added = (stats.num_drafts - before[0], stats.num_draft_tokens - before[1], stats.num_accepted_tokens - before[2],
             [a - b for a, b in zip(stats.accepted_per_position, before[3])])
    return outs, added


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _agree(got: list[list[int]], want: list[list[int]], gaps: list[list[float]]) -> None:
    """The comparison rule: equal until the first difference, which only a near tie (`gaps`:
    `want`'s top-1 / top-2 logit gap at each output) may cause."""
    for row, (g, w, gap) in enumerate(zip(got, want, gaps)):
        differ = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if differ is not None:
            assert gap[differ] <= GAP, (row, differ)
        else:
            assert len(g) == len(w), row


def _gaps(outs) -> list[list[float]]:
    """Each output's top-1 / top-2 logit gap, from its two top logprobs (raw: a logit difference)."""
    return [[float(np.subtract(*sorted((lp.logprob for lp in entry.values()), reverse=True)[:2]))
             for entry in o.outputs[0].logprobs] for o in outs]


def test_greedy_speculation_emits_what_decoding_emits_with_every_drafter(llm):
    """With the MTP block, a drafter whose drafts are all kept, one whose drafts are all rejected,
    one rejected at every position in turn, and fewer drafts than k, the tokens are decoding's
    (the comparison rule, its gaps from decoding's own logprobs), and the counters say what the
    drafter did; nothing compiles."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    base_outs, _ = _generate(llm, NO_DRAFTS, params)
    base, reference = _tokens(base_outs), _gaps(base_outs)
    runs = {tuple(p): out for p, out in zip(PROMPTS, base)}
    drafters = {
        "all kept": ReplayDrafter(runs, CONFIG.vocab_size),
        "all rejected": ReplayDrafter(runs, CONFIG.vocab_size, right=lambda done, k: 0),
        "rejected at every position": ReplayDrafter(runs, CONFIG.vocab_size, right=lambda done, k: done % (k + 1)),
        "one draft": ReplayDrafter(runs, CONFIG.vocab_size, limit=1),
        "two drafts, the second rejected": ReplayDrafter(runs, CONFIG.vocab_size, right=lambda done, k: 1, limit=2),
        "the MTP block": None,
    }
    counter = CompileCounter()  # from here on: the warmed-up engine only
    for name, drafter in drafters.items():
        outs, (drafts, draft_tokens, accepted, per_position) = _generate(llm, drafter, params)
        _agree(_tokens(outs), base, reference)
        assert drafts > 0 and sum(per_position) == accepted, name
        if name in ("all kept", "one draft"):
            assert accepted == draft_tokens and drafts <= 3 * 40 / (1 + draft_tokens / drafts) + 3, name
        if name == "all rejected":
            assert accepted == 0 and draft_tokens > 2 * drafts, name  # fewer only near max_tokens
        if name == "rejected at every position":
            assert 0 < accepted < draft_tokens and all(n > 0 for n in per_position), (name, per_position)
        if name == "two drafts, the second rejected":
            assert per_position == [drafts, 0, 0] and draft_tokens == 2 * drafts, (name, per_position)
    assert counter.compiles == 0  # verify rows run in the buckets compiled at warm-up, and so does the drafter


def test_seeded_sampling_gives_the_same_tokens_and_logprobs_with_drafts(llm):
    """A seed keys each output index, so a speculative run draws the tokens decoding draws (top-p,
    min_tokens and a logit bias applied at every verify position), and their logprobs."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=30, min_tokens=4, logprobs=2,
                            logit_bias={5: 2.0}, ignore_eos=False)
    base_outs, _ = _generate(llm, NO_DRAFTS, params)
    base = _tokens(base_outs)
    runs = {tuple(p): out for p, out in zip(PROMPTS, base)}
    for drafter in (ReplayDrafter(runs, CONFIG.vocab_size), ReplayDrafter(runs, CONFIG.vocab_size,
                                                                           right=lambda done, k: done % (k + 1))):
        outs, (_, draft_tokens, accepted, _) = _generate(llm, drafter, params)
        assert _tokens(outs) == base and accepted > 0
        for got, want in zip(outs, base_outs):
            g, w = got.outputs[0], want.outputs[0]
            assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]
            for ge, we in zip(g.logprobs, w.logprobs):
                assert all(abs(ge[t].logprob - we[t].logprob) <= 1e-4 for t in we)
            assert abs(g.cumulative_logprob - w.cumulative_logprob) <= 1e-3
            assert g.finish_reason == w.finish_reason


def test_no_token_after_a_stop_or_past_max_tokens_is_emitted(llm):
    """A stop token, a stop string or max_tokens inside a step's accepted drafts ends the output
    there, as decoding ends it: the drafts after it are dropped."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = _tokens(_generate(llm, NO_DRAFTS, greedy)[0])
    runs = {tuple(p): out for p, out in zip(PROMPTS, base)}
    kept = ReplayDrafter(runs, CONFIG.vocab_size)
    stop_token = base[0][13]
    text = llm.tokenizer.decode(base[1][:30])
    cases = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
             SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[text[-4:]] if text.strip() else None)]
    for params in cases:
        want, _ = _generate(llm, NO_DRAFTS, params)
        got, (_, _, accepted, _) = _generate(llm, kept, params)
        assert accepted > 0
        for g, w in zip(got, want):
            g, w = g.outputs[0], w.outputs[0]
            assert (list(g.token_ids), g.text, g.finish_reason, g.stop_reason) == \
                   (list(w.token_ids), w.text, w.finish_reason, w.stop_reason)
    stopped = _generate(llm, kept, cases[0])[0][0].outputs[0]
    assert stopped.token_ids[-1] == stop_token and len(stopped.token_ids) <= 14 and stopped.finish_reason == "stop"
    assert [len(o.outputs[0].token_ids) for o in _generate(llm, kept, cases[1])[0]] == [13, 13, 13]


def test_prefix_hits_and_parallel_samples_with_the_mtp_drafter(llm):
    """A prompt longer than a block, twice: the second hits its first block (128 cached tokens)
    and both give decoding's tokens; a block completed by accepted drafts is hit by the next turn;
    n = 2 seeded samples equal decoding's."""
    long_prompt = [np.random.default_rng(4).integers(0, CONFIG.vocab_size, size=150).tolist()]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _tokens(_generate(llm, NO_DRAFTS, greedy, long_prompt)[0])
    assert llm.reset_prefix_cache()
    first, _ = _generate(llm, None, greedy, long_prompt)
    second, (drafts, _, _, _) = _generate(llm, None, greedy, long_prompt)
    assert second[0].num_cached_tokens == 128 and drafts > 0
    assert _tokens(first) == want and _tokens(second) == want
    # A block completed inside accepted drafts is cached with its snapshot (drafts stop at a block
    # boundary, so some row ends there): a next turn over the output hits it.
    turn = [np.random.default_rng(6).integers(0, CONFIG.vocab_size, size=100).tolist()]
    reply = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    base = _tokens(_generate(llm, NO_DRAFTS, reply, turn)[0])
    assert llm.reset_prefix_cache()
    _, (_, draft_tokens, accepted, _) = _generate(llm, ReplayDrafter({tuple(turn[0]): base[0]}, CONFIG.vocab_size),
                                                  reply, turn)
    assert accepted == draft_tokens > 30
    next_turn, _ = _generate(llm, NO_DRAFTS, SamplingParams(temperature=0.0, max_tokens=2),
                             [turn[0] + base[0][:40] + [1, 2, 3]])
    assert next_turn[0].num_cached_tokens == 128
    parallel = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    base = [[list(c.token_ids) for c in o.outputs] for o in _generate(llm, NO_DRAFTS, parallel, PROMPTS[:1])[0]]
    got = [[list(c.token_ids) for c in o.outputs] for o in _generate(llm, None, parallel, PROMPTS[:1])[0]]
    assert got == base and len(base[0]) == 2


def test_an_abort_between_verify_steps_harms_no_other_request(llm):
    """Two requests speculate with the MTP block; one is aborted after a few steps, its slot and
    blocks freed, and a new request takes them: the others' tokens are decoding's."""
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _tokens(_generate(llm, NO_DRAFTS, greedy, PROMPTS[:2])[0])
    engine = llm.engine
    engine.drafter = None
    engine.add_request("kept", PROMPTS[0], greedy)
    engine.add_request("aborted", PROMPTS[1], greedy)
    for _ in range(6):
        engine.step()
    assert engine.abort("aborted") is not None
    engine.add_request("after", PROMPTS[1], greedy)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert done == {"kept": want[0], "after": want[1]}
    engine.scheduler.check_invariants()
    assert all(not bm._holders for bm in engine.scheduler.block_managers)
