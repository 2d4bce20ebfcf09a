"""Speculative decoding's acceptance through the engine's own sampler (engine/speculative.py):
every position of a verify row is sampled as the row would sample it there, and drafts are kept
while the token sampled before each equals it. With a greedy (one-hot) draft this must be
rejection sampling: the draft is kept with probability p0(d), a rejected position's token
follows p0 without d (normalise(max(0, p0 - q))), the token after a kept draft follows p1, and
the first emitted token follows p0 whatever the draft. Chi-square tests against those, with
enough samples to refuse positions drawn with one key (correlated draws)."""

from __future__ import annotations

import numpy as np
from scipy import stats

from dsv4_jax.engine.sampler import SamplerConfig, SamplingRow, build_sampling_batch, sample
from dsv4_jax.engine.sampling_params import SamplingParams
from dsv4_jax.engine.speculative import accepted_tokens

V, TRIALS = 6, 30_000
P_VALUE = 1e-6  # a correct sampler fails one run in a million


def _logits(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=V) * 1.5).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _chi2(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=V)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep].astype(np.float64) / probs[keep].sum() * len(tokens)
    return stats.chisquare(counts[keep], expected * counts[keep].sum() / expected.sum()).pvalue


def _verify(draft: int, params: SamplingParams, independent: bool = True) -> list[list[int]]:
    """TRIALS verify rows of one draft over fixed logits (position 0: p0, position 1: p1), each
    row an unseeded request of its own; `independent=False` draws both positions with one key."""
    rows, logits = [], []
    p0, p1 = _logits(1), _logits(2)
    for trial in range(TRIALS):
        rows.append(SamplingRow(params, trial, draft_position=0))
        rows.append(SamplingRow(params, trial, output_token_ids=[draft], draft_position=int(independent)))
        logits += [p0, p1]
    batch = build_sampling_batch(rows, len(rows), vocab_size=V, engine_seed=3, step=5, config=SamplerConfig())
    sampled = np.asarray(sample(np.stack(logits), batch).token_ids)[: len(rows)].reshape(TRIALS, 2)
    return [accepted_tokens(row, [draft]) for row in sampled]


def test_a_sampled_row_with_a_greedy_draft_is_rejection_sampling():
    p0, p1 = _softmax(_logits(1)), _softmax(_logits(2))
    draft = int(np.argsort(p0)[-2])  # a likely token, not the likeliest: kept and rejected often
    emitted = _verify(draft, SamplingParams(temperature=1.0))
    first = np.array([e[0] for e in emitted])
    kept = np.array([len(e) == 2 for e in emitted])
    assert _chi2(first, p0) > P_VALUE  # what decoding without the draft would emit
    assert stats.binomtest(int(kept.sum()), TRIALS, p0[draft]).pvalue > P_VALUE  # kept with probability p0(d)
    assert _chi2(np.array([e[1] for e in emitted if len(e) == 2]), p1) > P_VALUE
    residual = np.where(np.arange(V) == draft, 0.0, p0)  # normalise(max(0, p0 - onehot(d)))
    assert _chi2(first[~kept], residual) > P_VALUE
    # The same test refuses both positions drawn with one key: the token after a kept draft then
    # depends on the draw that kept it.
    correlated = _verify(draft, SamplingParams(temperature=1.0), independent=False)
    assert _chi2(np.array([e[1] for e in correlated if len(e) == 2]), p1) < P_VALUE


def test_truncated_rows_follow_their_truncated_distribution_at_every_position():
    """top_k 3 and temperature 0.7 (the candidates' draw): each position follows the row's own
    distribution there (p0 and p1 truncated and scaled), a draft outside p0's top 3 is never kept."""
    params = SamplingParams(temperature=0.7, top_k=3)

    def truncated(logits):
        keep = np.argsort(logits)[-3:]
        scaled = np.where(np.isin(np.arange(V), keep), logits / 0.7, -np.inf)
        return _softmax(scaled)

    p0, p1 = truncated(_logits(1)), truncated(_logits(2))
    draft = int(np.argsort(p0)[-2])
    emitted = _verify(draft, params)
    assert _chi2(np.array([e[0] for e in emitted]), p0) > P_VALUE
    assert _chi2(np.array([e[1] for e in emitted if len(e) == 2]), p1) > P_VALUE
    outside = int(np.argsort(p0)[0])
    assert all(len(e) == 1 for e in _verify(outside, params)[:2000])


def test_greedy_rows_keep_drafts_while_they_are_the_argmax():
    emitted = _verify(int(np.argmax(_logits(1))), SamplingParams(temperature=0.0))[:10]
    assert all(e == [int(np.argmax(_logits(1))), int(np.argmax(_logits(2)))] for e in emitted)
    wrong = int(np.argsort(_logits(1))[0])
    assert all(e == [int(np.argmax(_logits(1)))] for e in _verify(wrong, SamplingParams(temperature=0.0))[:10])
