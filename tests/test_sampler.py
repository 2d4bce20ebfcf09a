"""On-device sampling against numpy references of vLLM's sampling rules.

Compiles (cold cache): the draw at six shapes, among them (B=60,000, V=64: every distribution
test in one call), (B=2, V=129,280) and (B=512, V=64) twice (the first candidates against all K);
`process_logits` for the batches with bias, bans or penalties at two; the raw logprobs after it at
one: nine in all.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_jax.engine.request import PLACEHOLDER
from dsv4_jax.engine.sampler import (
    PenaltyHistory,
    SamplerConfig,
    SamplingRow,
    build_sampling_batch,
    process_logits,
    prompt_scores,
    row_argmax,
    row_top_k,
    sample,
)
from dsv4_jax.engine.sampling_params import MAX_LOGPROBS, SamplingParams

V = 128
B = 32
EOS = 7


def _run(logits: np.ndarray, rows, *, bucket: int | None = None, **kwargs):
    batch = build_sampling_batch(rows, bucket or len(rows), vocab_size=logits.shape[-1], **kwargs)
    out = sample(*jax.device_put((logits, batch)))
    return jax.tree.map(np.asarray, out)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---- numpy references of vLLM's rules ---------------------------------------------------------


def _processed_reference(logits: np.ndarray, row: SamplingRow, eos_ids) -> np.ndarray:
    """vLLM v1 order: logit_bias, min_tokens bans, then repetition, frequency, presence."""
    p, x = row.params, logits.astype(np.float64).copy()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    if len(row.output_token_ids) < p.min_tokens:  # EOS too with ignore_eos: vLLM's stop-id set always holds it
        x[list(p.stop_token_ids) + list(eos_ids)] = -np.inf
    seen = np.zeros(len(x), bool)
    seen[list(row.prompt_token_ids) + list(row.output_token_ids)] = True
    r = p.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    counts = np.bincount(np.asarray(row.output_token_ids, int), minlength=len(x))
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def _distribution_reference(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Exact probabilities over the whole vocabulary: temperature, min_p, top_k, then top_p over
    the renormalised survivors (vLLM sorts ascending and drops while the cumulative mass <= 1 - p,
    never the most likely token)."""
    x = logits.astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs >= p.min_p * probs.max()
    if p.top_k > 0:
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    survivors = np.where(keep, probs, 0.0) / probs[keep].sum()
    ascending = np.argsort(survivors, kind="stable")
    dropped = np.cumsum(survivors[ascending]) <= 1 - p.top_p
    dropped[-1] = False
    keep[ascending[dropped]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def _chi_square_critical(df: int, z: float = 3.090232) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z is the normal quantile
    (3.090232 for p = 0.001). It errs high, by 2.3% at df = 2, 0.6% at 10 and 0.1% at 50."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * np.sqrt(h)) ** 3


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over bins of expected count >= 5 (the rest pooled into one bin) and
    its degrees of freedom."""
    expected = counts.sum() * probs
    order = np.argsort(-expected)
    big = order[expected[order] >= 5]
    rest = order[expected[order] < 5]
    obs, exp = list(counts[big].astype(float)), list(expected[big])
    if expected[rest].sum() >= 5:
        obs.append(counts[rest].sum())
        exp.append(expected[rest].sum())
    else:  # too little to stand alone: pool it with the smallest bin
        obs[-1] += counts[rest].sum()
        exp[-1] += expected[rest].sum()
    obs, exp = np.array(obs), np.array(exp)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def test_chi_square_critical_matches_tables():
    # Published 0.999 quantiles of chi-square with 10 and 50 degrees of freedom.
    assert _chi_square_critical(10) == pytest.approx(29.588, rel=1e-2)
    assert _chi_square_critical(50) == pytest.approx(86.661, rel=2e-3)


# ---- distributions ----------------------------------------------------------------------------

DRAWS = 10_000
DISTRIBUTIONS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(top_k=10),
    "top_p": SamplingParams(temperature=0.9, top_p=0.8),
    "min_p": SamplingParams(min_p=0.1),
    "min_p + top_k + top_p": SamplingParams(temperature=1.3, min_p=0.02, top_k=20, top_p=0.7),
    "top_k = V + top_p": SamplingParams(temperature=0.9, top_k=64, top_p=0.8),  # top_k of the whole vocabulary: off
}


# Rows with top-k or top-p draw among K candidates: K = 32 of the 64 tokens holds every top-k and
# top-p nucleus below (at most 14 tokens), while rows without either must reach past the K. The
# first 12 candidates hold some of them (top_k = 10, min_p) but not the 14-token nuclei, so both
# draws are checked.
DRAW_CONFIG = SamplerConfig(candidates=32, first_candidates=12)


@pytest.fixture(scope="module")
def draws():
    """10,000 unseeded draws per distribution, all in one call (one compile)."""
    row_logits = (np.random.default_rng(5).normal(size=64) * 1.5).astype(np.float32)
    rows = [
        SamplingRow(p, request_index=i * DRAWS + j) for i, p in enumerate(DISTRIBUTIONS.values()) for j in range(DRAWS)
    ]
    batch = build_sampling_batch(rows, len(rows), vocab_size=64, engine_seed=11, step=3, config=DRAW_CONFIG)
    tokens = np.asarray(sample(*jax.device_put((np.tile(row_logits, (len(rows), 1)), batch)), config=DRAW_CONFIG)
                        .token_ids)
    return row_logits, dict(zip(DISTRIBUTIONS, tokens.reshape(len(DISTRIBUTIONS), DRAWS)))


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_draws_follow_the_exact_distribution(draws, name):
    row_logits, tokens = draws
    probs = _distribution_reference(row_logits, DISTRIBUTIONS[name])
    counts = np.bincount(tokens[name], minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "sampled a token the rules exclude"
    statistic, df = _chi_square(counts, probs)
    assert statistic < _chi_square_critical(df), (name, statistic, df)


def test_rows_without_top_k_or_top_p_are_not_cut_at_the_candidates(draws):
    row_logits, tokens = draws
    beyond = np.argsort(-row_logits, kind="stable")[DRAW_CONFIG.candidates :]
    probs = _distribution_reference(row_logits, DISTRIBUTIONS["temperature"])
    drawn = np.isin(tokens["temperature"], beyond).sum()
    expected = DRAWS * probs[beyond].sum()  # ~178 of 10,000 (1.8% of the mass)
    assert abs(drawn - expected) < 5 * np.sqrt(expected), (drawn, expected)


def test_rows_draw_the_same_token_among_the_first_candidates_as_among_all_k():
    """A row whose kept tokens all lie among the first candidates draws there; one whose kept
    tokens reach past them draws among all K. Either way the token is the one the K alone give."""
    vocab, count = 64, 512
    rng = np.random.default_rng(21)
    logits = (rng.normal(size=(count, vocab)) * rng.uniform(0.2, 3.0, size=(count, 1))).astype(np.float32)
    rows = [SamplingRow(SamplingParams(
        temperature=float(rng.choice([0.5, 1.0, 1.5])), top_k=int(rng.choice([0, 3, 8, 9, 20, 64])),
        top_p=float(rng.choice([0.5, 0.9, 0.99])), min_p=float(rng.choice([0.0, 0.05])),
        seed=int(rng.integers(0, 2**40))), i) for i in range(count)]
    first, all_k = SamplerConfig(candidates=32, first_candidates=8), SamplerConfig(candidates=32, first_candidates=32)
    batch = build_sampling_batch(rows, count, vocab_size=vocab, config=first)
    tokens = [np.asarray(sample(*jax.device_put((logits, batch)), config=c).token_ids) for c in (first, all_k)]
    np.testing.assert_array_equal(tokens[0], tokens[1])
    kept = np.array([(_distribution_reference(x, r.params) > 0).sum() for x, r in zip(logits, rows)])
    rank = np.array([(x > x[t]).sum() for x, t in zip(logits, tokens[1])])
    assert (kept <= 8).sum() > 100 and (kept > 8).sum() > 100, np.bincount(kept)
    assert (rank >= 8).sum() > 40, "too few draws past the first candidates to check the switch"


# ---- one step of 32 mixed requests ------------------------------------------------------------


def _mixed_rows(rng: np.random.Generator) -> list[SamplingRow]:
    """32 rows: penalties, biases, min_tokens bans, greedy and random rows, logprob requests."""
    rows = []
    for i in range(B):
        prompt = rng.integers(0, V, rng.integers(1, 40)).tolist()
        output = rng.integers(0, V, rng.integers(0, 12)).tolist()
        params = SamplingParams(
            temperature=0.0 if i % 2 else float(rng.uniform(0.5, 1.5)),
            top_k=int(rng.integers(0, 30)),
            repetition_penalty=float(rng.uniform(0.5, 2.0)) if i % 3 else 1.0,
            frequency_penalty=float(rng.uniform(-2, 2)) if i % 4 else 0.0,
            presence_penalty=float(rng.uniform(-2, 2)) if i % 5 else 0.0,
            logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, V, 3)} if i % 6 else None,
            min_tokens=int(rng.integers(0, 20)),
            max_tokens=64,
            stop_token_ids=[int(rng.integers(0, V))],
            ignore_eos=bool(i % 7 == 0),
            seed=int(rng.integers(0, 2**40)) if i % 8 else None,
            logprobs=int(rng.integers(0, MAX_LOGPROBS + 1)) if i % 3 else None,
        )
        rows.append(SamplingRow(params, request_index=i, prompt_token_ids=prompt, output_token_ids=output))
    return rows


@pytest.fixture(scope="module")
def mixed():
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    rows = _mixed_rows(rng)
    return logits, rows, _run(logits, rows, eos_token_ids=[EOS])


def test_programs_compiled_ahead_serve_the_calls_and_give_what_the_jitted_calls_give(mixed):
    """`Sampler.compile` builds every program sampling these batches runs, several at once: the
    draw, and for a batch with a bias, bans and penalties its edit and the raw logprobs after the
    draw. Calls of those shapes then build nothing, and give exactly what `sample` (the jitted
    calls) gave."""
    from dsv4_jax.engine.compiles import CompileCounter
    from dsv4_jax.engine.sampler import Sampler

    logits, rows, expected = mixed
    logits = jax.device_put(logits)
    plain = build_sampling_batch([SamplingRow(SamplingParams(temperature=1.0, logprobs=2), 0, [1], [])] * B, B,
                                 vocab_size=V)
    edited = build_sampling_batch(rows, B, vocab_size=V, eos_token_ids=[EOS])
    sampler = Sampler(SamplerConfig())
    assert sampler.compile([(logits, plain), (logits, edited), (logits, plain)]) == 3  # draw, edit, logprobs
    counter = CompileCounter()
    first = sampler(logits, plain)
    got = jax.tree.map(np.asarray, sampler(logits, edited))
    assert counter.built == 0
    assert first.token_ids.shape == (B,)
    for name in ("token_ids", "logprobs", "top_token_ids", "top_logprobs", "ranks"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)


def test_process_logits_matches_vllm_rules(mixed):
    logits, rows, _ = mixed
    batch = build_sampling_batch(rows, B, vocab_size=V, eos_token_ids=[EOS])
    # With previous token ids as the sampler passes them (nothing pending reads them): the
    # executable `mixed` compiled.
    processed = np.asarray(jax.jit(process_logits)(*jax.device_put((logits, batch)), np.zeros(B, np.int32)))
    expected = np.stack([_processed_reference(x, row, [EOS]) for x, row in zip(logits, rows)])
    assert np.isinf(expected).any() and (np.abs(expected - logits) > 1e-3).mean() > 0.1  # the rules bite
    np.testing.assert_allclose(processed, expected, rtol=1e-6, atol=1e-5)


def test_kept_histories_in_a_doubled_width_process_the_same_logits(mixed):
    """The engine's way: each row's history kept and caught up in two parts, in a batch whose
    longest history is wider than `penalty_history` (16: it takes the narrowest doubling), and
    every other row's last output pending (async scheduling: a PLACEHOLDER, read from the previous
    step's token ids on the device)."""
    logits, rows, _ = mixed
    previous = np.zeros(2 * B, np.int32)  # the previous step's token ids: row i's pending token at 2i + 1
    kept = []
    for i, row in enumerate(rows):
        outputs = list(row.output_token_ids)
        if outputs and i % 2:
            previous[2 * i + 1], outputs[-1] = outputs[-1], PLACEHOLDER
        kept.append(dataclasses.replace(row, output_token_ids=outputs, previous_row=2 * i + 1,
                                        penalty_history=PenaltyHistory(row.prompt_token_ids)
                                        .catch_up(outputs[:3]).catch_up(outputs)))
    assert sum(row.params.has_penalties and row.output_token_ids[-1:] == [PLACEHOLDER] for row in kept) > 5
    longest = max(len({*row.prompt_token_ids, *row.output_token_ids}) for row in rows if row.params.has_penalties)
    assert longest > 32
    batch = build_sampling_batch(kept, B, vocab_size=V, eos_token_ids=[EOS], config=SamplerConfig(penalty_history=16))
    assert batch.penalties.token_ids.shape == (B, 16 * 2 ** math.ceil(math.log2(longest / 16)))
    processed = np.asarray(jax.jit(process_logits)(*jax.device_put((logits, batch, previous))))
    expected = np.stack([_processed_reference(x, row, [EOS]) for x, row in zip(logits, rows)])
    np.testing.assert_allclose(processed, expected, rtol=1e-6, atol=1e-5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30), st.lists(st.integers(0, 40), max_size=30), st.data())
def test_a_kept_history_counts_what_the_whole_lists_count(prompt, outputs, data):
    history, counted = PenaltyHistory(prompt), 0
    while counted < len(outputs):  # caught up in random parts, as steps come
        counted = data.draw(st.integers(counted + 1, len(outputs)))
        history.catch_up(outputs[:counted])
    got = dict(zip(history.token_ids, history.output_counts))
    assert len(got) == history.size == len({*prompt, *outputs})
    assert got == {t: outputs.count(t) for t in {*prompt, *outputs}}
    history.catch_up([*outputs, PLACEHOLDER])  # a pending last token waits until it is known
    assert dict(zip(history.token_ids, history.output_counts)) == got and history.num_outputs == len(outputs)
    assert history.pending and not history.catch_up(outputs).pending
    with pytest.raises(ValueError, match="output token id -1"):  # anywhere else it is a bug
        history.catch_up([*outputs, PLACEHOLDER, 5])


def test_greedy_rows_take_the_argmax_after_penalties_and_bans(mixed):
    logits, rows, out = mixed
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    expected = [np.argmax(_processed_reference(logits[i], rows[i], [EOS])) for i in greedy]
    assert (np.array(expected) != logits[greedy].argmax(-1)).any()  # penalties changed some argmax
    np.testing.assert_array_equal(out.token_ids[greedy], expected)


def test_logprobs_are_the_raw_model_distribution(mixed):
    logits, _, out = mixed
    reference = _log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, reference[np.arange(B), out.token_ids], atol=1e-5)
    top = np.argsort(-reference, axis=-1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(out.top_token_ids, top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(reference, top, -1), atol=1e-5)
    chosen = reference[np.arange(B), out.token_ids]
    np.testing.assert_array_equal(out.ranks, 1 + (reference > chosen[:, None]).sum(-1))  # vLLM's rank


def test_ranks_and_logprobs_from_the_top_list_equal_the_whole_vocabulary_count():
    """A batch whose tokens all rank within the top logprobs list takes ranks and the logsumexp
    shift from that list; with ties, -inf and a token outside the list (the whole count) too."""
    rng = np.random.default_rng(8)
    row = np.round(rng.normal(size=V) * 2) / 2  # many ties
    row[rng.choice(V, 10, replace=False)] = -np.inf
    logits = row[None].astype(np.float32)
    reference = _log_softmax(logits)[0]
    seen = set()
    for seed in range(16):  # the (B=1, V=128) compile of the seed tests
        top_k = 6 if seed < 12 else 0  # within the list, then (mostly) the whole vocabulary
        out = _run(logits, [SamplingRow(SamplingParams(temperature=1.5, top_k=top_k, logprobs=3, seed=seed), 0)])
        token = int(out.token_ids[0])
        seen.add((top_k, int((row > row[token]).sum()) < MAX_LOGPROBS))
        assert out.ranks[0] == 1 + (row > row[token]).sum(), (seed, token)
        np.testing.assert_allclose(out.logprobs[0], reference[token], atol=1e-5)
        np.testing.assert_allclose(out.top_logprobs[0], np.sort(reference)[::-1][:MAX_LOGPROBS], atol=1e-5)
    assert {(6, True), (0, False)} <= seen, seen  # both ways of counting ran


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = np.zeros((1, V), np.float32)
    logits[0, EOS], logits[0, 20], logits[0, 30] = 9.0, 8.0, 7.0  # EOS best, then stop id 20
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[20])
    cases = [  # (row, expected token); one row per call reuses the B = 1 compile of the seed tests
        (SamplingRow(params, 0, output_token_ids=[1, 2]), 30),  # below min_tokens: EOS and 20 banned
        (SamplingRow(params, 1, output_token_ids=[1, 2, 3]), EOS),  # reached: nothing banned
        # vLLM bans EOS below min_tokens with ignore_eos too (its stop-id set always holds EOS).
        (SamplingRow(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True), 2), 20),
        (SamplingRow(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True), 3, output_token_ids=[1, 2, 3]),
         EOS),
    ]
    for row, expected in cases:
        assert _run(logits, [row], eos_token_ids=[EOS]).token_ids[0] == expected, row


# ---- seeds ------------------------------------------------------------------------------------

SEED = 1234
STEPS = 4


def _seeded_tokens(row_logits, seed, *, others=None, position=0):
    """The tokens a seeded request draws over STEPS steps, alone (B = 1) or at `position`
    among `others`; also the tokens of every row of the last step."""
    tokens, out = [], None
    for n in range(STEPS):
        row = SamplingRow(SamplingParams(temperature=1.0, top_p=0.95, seed=seed), 0, output_token_ids=tokens[:])
        rows = [row] if others is None else others[:position] + [row] + others[position + 1 :]
        logits = np.tile(row_logits, (len(rows), 1))
        out = _run(logits, rows, engine_seed=99, step=n)
        tokens.append(int(out.token_ids[position]))
    return tokens, out


def test_same_seed_gives_the_same_tokens_alone_and_in_a_batch(mixed):
    _, others, _ = mixed
    row_logits = np.linspace(0, 1, V, dtype=np.float32)  # nearly flat: every draw matters
    alone, _ = _seeded_tokens(row_logits, SEED)
    twins = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.95, seed=SEED), 5)] + others[1:]
    in_batch, out = _seeded_tokens(row_logits, SEED, others=twins, position=17)
    assert alone == in_batch
    assert out.token_ids[0] == alone[0]  # the twin at row 0 drew its first token, like step 0
    assert len(set(alone)) > 1  # the counter moves the stream from step to step


def test_different_seeds_give_different_tokens():
    row_logits = np.linspace(0, 1, V, dtype=np.float32)
    streams = {tuple(_seeded_tokens(row_logits, seed)[0]) for seed in (SEED, SEED + 1, 2**40 + SEED)}
    assert len(streams) == 3


# ---- the real vocabulary ----------------------------------------------------------------------


def test_real_vocabulary_greedy_top_k_and_logprobs():
    vocab = 129_280
    logits = (np.random.default_rng(2).normal(size=(2, vocab)) * 4).astype(np.float32)
    rows = [
        SamplingRow(SamplingParams(temperature=0, logprobs=3), 0),
        SamplingRow(SamplingParams(temperature=1.0, top_k=50, seed=7), 1),
    ]
    out = _run(logits, rows)
    assert out.token_ids[0] == logits[0].argmax()
    assert out.token_ids[1] in np.argsort(-logits[1])[:50]
    reference = _log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, reference[[0, 1], out.token_ids], atol=1e-5)


# ---- host side: SamplingParams and the batch builder ------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name, shown",
    [
        ({"temperature": -0.1}, "temperature", "-0.1"),
        ({"temperature": float("nan")}, "temperature", "nan"),
        ({"temperature": True}, "temperature", "True"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"top_k": 2.0}, "top_k", "2.0"),
        ({"min_p": 1.1}, "min_p", "1.1"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "-2.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs", "21"),
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs", "21"),
        ({"n": 0}, "n", "0"),
        ({"n": True}, "n", "True"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "at most max_tokens (4), got 5"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"seed": 2**63}, "seed", str(2**63)),
        ({"seed": "7"}, "seed", "'7'"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "'5'"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias", "inf for 5"),
        ({"logit_bias": {t: 1.0 for t in range(301)}}, "logit_bias", "at most 300 {token id: bias} entries, got 301"),
        ({"logit_bias": {5: 1e39}}, "logit_bias", "float32 numbers, got 1e+39 for 5"),  # inf in float32
        ({"temperature": 1e39}, "temperature", "1e+39"),
        ({"stop": ["x"] * 129}, "stop", "at most 128 strings, got 129"),
        ({"stop": ""}, "stop", "''"),
        ({"stop": ["a", 3]}, "stop", "['a', 3]"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "[-1]"),
        ({"stop_token_ids": 5}, "stop_token_ids", "5"),
        ({"ignore_eos": 1}, "ignore_eos", "1"),
        ({"n": 2, "temperature": 0}, "n", "1 when using greedy sampling (temperature 0), got 2"),  # vLLM refuses too
    ],
)
def test_sampling_params_errors_name_the_argument_and_value(kwargs, name, shown):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{name}\b") as error:
        SamplingParams(**kwargs)
    assert shown in str(error.value)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.stop, p.stop_token_ids) == (
        1, 1.0, 1.0, 0, 0.0, 16, [], []
    )
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100
    # vLLM's: seed -1 is no seed; a positive temperature below 0.01 is 0.01 (only 0 is greedy).
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert [SamplingParams(temperature=t).temperature for t in (0.0, 1e-6, 0.005, 0.01, 0.02)] == [
        0.0, 0.01, 0.01, 0.01, 0.02]
    assert not SamplingParams(temperature=1e-6, n=2).greedy


def test_token_ids_outside_the_vocabulary_are_rejected():
    cases = (({"logit_bias": {V: 1.0}}, "logit_bias", V), ({"stop_token_ids": [V + 3]}, "stop_token_ids", V + 3))
    for kwargs, name, bad in cases:
        message = rf"SamplingParams\.{name} has token ids \[{bad}\] outside the vocabulary \[0, {V}\)"
        with pytest.raises(ValueError, match=message):
            build_sampling_batch([SamplingRow(SamplingParams(**kwargs), 0)], 1, vocab_size=V)


def test_choices_of_a_request_take_seed_plus_index_within_int64():
    top = 2**63 - 1
    assert [SamplingParams(n=3, seed=5).for_child(i).seed for i in range(3)] == [5, 6, 7]
    assert [SamplingParams(n=3, seed=top - 1).for_child(i).seed for i in range(3)] == [top - 1, top, -(2**63)]
    assert SamplingParams(n=2).for_child(1).seed is None and SamplingParams(n=2, seed=1).for_child(1).n == 1
    assert [SamplingParams(n=2, seed=-2).for_child(i).seed for i in range(2)] == [-2, -1]  # -1 a child's seed here


def test_a_top_k_past_the_vocabulary_is_off_whatever_its_size():
    # Any int is a valid top_k (vLLM); one of the vocabulary or more keeps every token. The batch
    # holds top_k as int32, where 2**31 would not fit: it must not fail the step of every request.
    rows = [SamplingRow(SamplingParams(top_k=k, seed=1), 0) for k in (V - 1, V, 2**31, 2**70)]
    batch = build_sampling_batch(rows, 4, vocab_size=V)
    assert batch.top_k.tolist() == [V - 1, 0, 0, 0]


def test_batch_builder_rejects_what_does_not_fit():
    banned = SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=[1, 2, 3]), 0)
    with pytest.raises(ValueError, match=r"SamplerConfig\.max_banned_ids \(2\)"):
        build_sampling_batch([banned], 1, vocab_size=V, config=SamplerConfig(max_banned_ids=2))
    with pytest.raises(ValueError, match="bucket 1 holds 1..1 rows, got 2"):
        build_sampling_batch([banned, banned], 1, vocab_size=V)
    with pytest.raises(ValueError, match=r"SamplerConfig\.candidates must be an int >= 1, got 0"):
        SamplerConfig(candidates=0)


@pytest.mark.parametrize("vocab", [1000, 1009])  # blocks of 40; a prime: no blocks, the plain argmax
def test_row_argmax_is_jnp_argmax_with_ties_infs_and_nans(vocab):
    """The blocked argmax gives numpy's index (the first maximum, the first NaN) on rows with ties
    across blocks, all -inf, +inf and -inf in different blocks, a NaN (the plain path), and noise."""
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[0, [7, 500, 999]] = 9.0  # ties in three blocks: the first wins
    x[1] = -np.inf
    x[2, [3, 700]] = [np.inf, -np.inf]
    x[3, [2, 600]] = [np.nan, 50.0]
    x[4, vocab - 1] = 30.0  # the very last entry
    got = np.asarray(jax.jit(row_argmax)(x))
    assert got.dtype == np.int32 and got.tolist() == np.argmax(x, axis=-1).tolist()
    x[3, 2] = 0.0  # no NaN left: the blocked path for every row
    assert np.asarray(jax.jit(row_argmax)(x)).tolist() == np.argmax(x, axis=-1).tolist()


def _numpy_top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of lax.top_k's documented order: NaNs first, then larger values, ties by lower index."""
    return np.stack([
        np.array(sorted(range(row.size), key=lambda j: (not np.isnan(row[j]), -np.nan_to_num(row[j], nan=0.0), j))[:k])
        for row in x
    ])


def test_row_top_k_is_lax_top_k_with_ties_infs_and_nans():
    """The two-pass top-k (blocks of 20 at V = 1000, k = 5) gives the ids and values of numpy's
    stable order on rows whose best entries share one block, ties spread over more blocks than
    k (the lowest indices win), all -inf, +inf and -inf in different blocks, noise, a tie between
    an earlier block and a later, better one, and a last row that holds a NaN, then +inf beside
    -inf in one block (both: the plain path for the batch), then neither (the blocked path)."""
    vocab, k = 1000, 5
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, vocab)).astype(np.float32)
    x[0, 60:66] = [9.0, 8.0, 9.5, 7.0, 8.5, 9.0]  # the best six in one block
    x[1, [999, 40, 940, 300, 10, 520, 77]] = 4.0  # seven ties in seven blocks: ids 10, 40, 77, 300, 520
    x[2] = -np.inf
    x[3, [3, 700]] = [np.inf, -np.inf]
    x[4, vocab - 3 :] = 30.0  # the very last entries
    x[5] = rng.uniform(-1.0, 1.0, vocab)  # equal entries in a better later block and an earlier one:
    x[5, [800, 801, 40, 41]] = [9.0, 3.0, 5.0, 3.0]  # 41 before 801
    top = jax.jit(row_top_k, static_argnums=1)
    for last in ([np.nan, 50.0], [np.inf, -np.inf], [0.0, 50.0]):
        x[6, [2, 3]] = last
        values, ids = map(np.asarray, top(x, k))
        want = _numpy_top_k(x, k)
        assert ids.dtype == np.int32 and ids.tolist() == want.tolist()
        np.testing.assert_array_equal(values, np.take_along_axis(x, want, axis=1))


def test_prompt_scores_on_the_device_equal_the_hosts():
    """`prompt_scores` (prefill steps' prompt logprobs, on the device) gives the entries of the
    engine's host scoring (`engine._prompt_scores`, float64 normalisation, numpy's order) on rows
    with many ties, -inf entries, a NaN and targets that tie with better-ranked tokens: the same
    ranks and top ids (ties by smaller id), logprobs within float32 rounding."""
    from dsv4_jax.engine.engine import _prompt_scores

    rng = np.random.default_rng(12)
    n, vocab = 6, 1000
    logits = (np.round(rng.normal(size=(n, vocab)) * 4) / 4).astype(np.float32)  # many ties
    logits[1, rng.choice(vocab, 50, replace=False)] = -np.inf
    logits[2, :40] = 7.0  # more tied best entries than MAX_LOGPROBS
    logits[4, 500] = np.nan  # a broken row: the NaN ranks first and the logprobs are NaN, no error
    # lax.top_k's total order: a NaN with its sign bit (what x86 arithmetic makes) below -inf, a
    # positive one above +inf
    logits[5, [2, 10]] = -np.float32(np.nan)
    logits[5, [5, 9]] = [np.inf, np.nan]
    targets = rng.integers(0, vocab, n).astype(np.int32)
    targets[2] = 25  # tied with the best
    targets[3] = int(np.argmax(logits[3]))
    logprob, rank, top_ids, top_logprobs = map(np.asarray, jax.jit(prompt_scores, static_argnums=2)(
        logits, targets, MAX_LOGPROBS))
    want_logprob, want_rank, want_ids, want_top = _prompt_scores(logits, targets, MAX_LOGPROBS)
    assert rank.tolist() == want_rank and top_ids.tolist() == want_ids
    assert rank[2] == 1 and top_ids[2].tolist() == list(range(MAX_LOGPROBS)) and top_ids[4, 0] == 500
    assert top_ids[5, :2].tolist() == [9, 5] and not {2, 10} & set(top_ids[5].tolist())
    np.testing.assert_allclose(logprob, want_logprob, atol=2e-6)
    np.testing.assert_allclose(top_logprobs, want_top, atol=2e-6)


# ---- token masks (structured outputs, allowed_token_ids, bad_words) -------------------------------


def test_mask_rows_round_trip_and_mask_exactly_their_tokens():
    """`packed_ids` sets the bits llguidance's layout gives each id (little-endian in int32
    words), `allowed_ids` reads them back, and `apply_token_masks` keeps exactly those logits."""
    from dsv4_jax.engine.sampler import apply_token_masks
    from dsv4_jax.engine.token_masks import allowed_ids, mask_width, packed_ids

    rng = np.random.default_rng(9)
    sets = [sorted(set(rng.integers(0, V, size=k).tolist())) for k in (1, 5, 40, V)] + [[0, 31, 32, 63, V - 1]]
    rows = np.stack([packed_ids(s, V) for s in sets])
    assert rows.shape == (len(sets), mask_width(V)) and rows.dtype == np.int32
    for row, ids in zip(rows, sets):
        np.testing.assert_array_equal(allowed_ids(row, V), ids)
        bits = np.zeros(mask_width(V) * 32, bool)
        bits[ids] = True  # the layout by hand: word t // 32, bit t % 32
        np.testing.assert_array_equal([(int(row[t // 32]) >> (t % 32)) & 1 for t in range(V)], bits[:V])
    logits = rng.normal(size=(len(sets), V)).astype(np.float32)
    masked = np.asarray(jax.jit(apply_token_masks)(logits, rows))
    for i, ids in enumerate(sets):
        keep = np.zeros(V, bool)
        keep[ids] = True
        np.testing.assert_array_equal(masked[i][keep], logits[i][keep])
        assert np.all(masked[i][~keep] == -np.inf)


_ROW_SETTINGS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    "top_k": st.sampled_from([0, 1, 5, 64]),
    "top_p": st.sampled_from([1.0, 0.9, 0.3]),
    "min_p": st.sampled_from([0.0, 0.1]),
    "seed": st.integers(0, 2**31),
    "repetition_penalty": st.sampled_from([1.0, 1.5]),
    "frequency_penalty": st.sampled_from([0.0, -2.0]),
    "min_tokens": st.sampled_from([0, 3]),
    "logprobs": st.sampled_from([None, 5]),
})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_ROW_SETTINGS, st.lists(st.integers(0, V - 1), min_size=1, max_size=6),
                          st.integers(0, V - 1)), min_size=1, max_size=B), st.integers(0, 2**31))
def test_a_masked_token_is_never_sampled_whatever_the_settings(rows, logit_seed):
    """Whatever the sampling settings, penalties, a large bias on a masked token and min_tokens
    bans, every row samples a token its mask allows (each mask holds at least one token that
    is not EOS, so the bans never empty it), and its logprobs are those of the masked logits."""
    from dsv4_jax.engine.token_masks import packed_ids

    logits = (np.random.default_rng(logit_seed).normal(size=(B, V)) * 4).astype(np.float32)
    sampling, masks = [], np.full((B, (V + 31) // 32), -1, np.int32)
    allowed = []
    for i, (settings_, ids, favoured) in enumerate(rows):
        ids = sorted(set(ids) - {EOS}) or [EOS + 1]
        allowed.append(ids)
        masks[i] = packed_ids(ids, V)
        params = SamplingParams(**settings_, logit_bias={favoured: 50.0})  # even a masked favourite stays out
        sampling.append(SamplingRow(params, i, [1, 2, favoured], [3]))
    out = _run(logits, sampling, bucket=B, eos_token_ids=[EOS], token_masks=masks)
    for i, ids in enumerate(allowed):
        assert int(out.token_ids[i]) in ids, (i, int(out.token_ids[i]), ids)
        if sampling[i].params.logprobs is not None:
            raw = np.full(V, -np.inf)
            raw[ids] = logits[i, ids]
            expected = _log_softmax(raw[None])[0]
            assert abs(out.logprobs[i] - expected[out.token_ids[i]]) <= 1e-4
            listed = out.top_token_ids[i][: sampling[i].params.logprobs]
            finite = out.top_logprobs[i][: sampling[i].params.logprobs] > -np.inf
            assert set(listed[finite].tolist()) <= set(ids)
