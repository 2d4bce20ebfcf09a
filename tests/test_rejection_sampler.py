"""Speculative decoding's acceptance (`engine/rejection_sampler.py`): what it emits is distributed
as the target model's own samples (chi-square against the target, with enough samples that a
wrong acceptance formula fails), and greedy rows equal greedy decoding of the target."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from dsv4_jax.engine.rejection_sampler import EMPTY, rejection_sample

V, N = 6, 60_000
P_VALUE = 1e-6  # a correct sampler fails one run in a million


def _probs(seed: int) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=V) * 1.5
    return np.exp(logits) / np.exp(logits).sum()


def _chi2(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=V)
    return stats.chisquare(counts, probs * len(tokens)).pvalue


SAMPLE = jax.jit(rejection_sample)  # numpy in, one compile per shape


def _run(p_rows: np.ndarray, q: np.ndarray | None, drafts: np.ndarray, seed: int = 0):
    """Every row with the same target p_rows [k + 1, V] (and draft distributions q [k, V])."""
    b = len(drafts)
    target = np.broadcast_to(p_rows.astype(np.float32), (b, *p_rows.shape))
    draft_probs = None if q is None else np.broadcast_to(q.astype(np.float32), (b, *q.shape))
    tokens, accepted = SAMPLE(target, drafts.astype(np.int32), draft_probs, np.zeros(b, bool),
                              jax.random.key(seed))
    return np.asarray(tokens), np.asarray(accepted)


def test_emitted_tokens_follow_the_target_at_every_position():
    """k = 2 drafts drawn from q, targets p0, p1, p2: the first emitted token follows p0; among
    rows that accepted the first draft, the second follows p1; among rows that accepted both, the
    bonus follows p2."""
    p = np.stack([_probs(1), _probs(2), _probs(3)])
    q = np.stack([_probs(4), _probs(5)])
    rng = np.random.default_rng(0)
    drafts = np.stack([rng.choice(V, size=N, p=q[i]) for i in range(2)], axis=1)
    tokens, accepted = _run(p, q, drafts)
    assert ((tokens != EMPTY).sum(1) == accepted + 1).all()
    assert _chi2(tokens[:, 0], p[0]) > P_VALUE
    assert _chi2(tokens[accepted >= 1, 1], p[1]) > P_VALUE
    assert _chi2(tokens[accepted == 2, 2], p[2]) > P_VALUE
    assert 0.2 < (accepted >= 1).mean() < 0.95  # the drafts are neither always kept nor always refused
    # Enough samples to fail a wrong formula: drawing the token at a rejection from p instead of
    # the residual max(0, p - q) gives this distribution, which the same test refuses.
    keep = np.minimum(1.0, p[0] / q[0])
    wrong_probs = q[0] * keep + (1 - (q[0] * keep).sum()) * p[0]
    assert _chi2(rng.choice(V, size=N, p=wrong_probs), p[0]) < 1e-12
    # Judging the drafts as if drawn greedily (q one-hot: kept with probability p(d), the residual
    # p without d) is exact too, whatever drew them (vLLM's way for drafts without probabilities).
    one_hot, _ = _run(p, None, drafts)
    assert _chi2(one_hot[:, 0], p[0]) > P_VALUE


def test_a_perfect_drafter_is_always_accepted_and_a_wrong_one_never():
    p = np.stack([np.eye(V)[3], np.eye(V)[1], _probs(6)])  # the target is sure of 3, then of 1
    tokens, accepted = _run(p, np.stack([np.eye(V)[3], np.eye(V)[1]]), np.tile([3, 1], (N, 1)))
    assert (accepted == 2).all() and (tokens[:, :2] == [3, 1]).all()
    assert _chi2(tokens[:, 2], p[2]) > P_VALUE
    tokens, accepted = _run(p, np.stack([np.eye(V)[0], np.eye(V)[0]]), np.zeros((N, 2), np.int64))
    assert (accepted == 0).all() and (tokens[:, 0] == 3).all() and (tokens[:, 1:] == EMPTY).all()


@pytest.mark.parametrize("drafts, accepted, tokens", [
    ([5, 2, 3], 2, [5, 2, 7, EMPTY]),
    ([5, 2, 7], 3, [5, 2, 7, 1]),
    ([0, 2, 7], 0, [5, EMPTY, EMPTY, EMPTY]),
])
def test_greedy_rows_emit_the_targets_argmax_up_to_the_first_wrong_draft(drafts, accepted, tokens):
    argmax = [5, 2, 7, 1]
    target = np.full((1, 4, 8), 0.01, np.float32)
    target[0, range(4), argmax] = 0.9
    out, n = SAMPLE(target, np.array([drafts], np.int32), None, np.ones(1, bool), jax.random.key(0))
    assert int(n[0]) == accepted and np.asarray(out)[0].tolist() == tokens
