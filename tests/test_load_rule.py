"""The load benchmark's comparison rule (benchmarks/load.py) and the indexer top-k margins it uses
(`dsv4_jax.testing.indexer_topk_margins`).

The margins are checked on a two-layer CSA model whose layers are stacked (one `nnx.scan`): the
scores they come from must rank the entries exactly as the dense forward of the same weights,
unrolled, picks them (recorded from inside that forward through its attention core), and the
margins must equal a position-by-position count from those scores. The rule is checked on
hand-made outputs (a near-tie excused, a real difference reported) and end to end on the model's
own margins.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4_jax
from dsv4_jax.engine.outputs import CompletionOutput, Logprob
from dsv4_jax.model.attention_core import dense_attention
from dsv4_jax.presets import get_config
from dsv4_jax.testing import indexer_scores, indexer_topk_margins, write_random_checkpoint

# Two CSA layers of one kind (no hash routing), so they stack; 4 tokens per entry, top-2 of them.
CONFIG = get_config("dsv4-tiny-test").replace(num_hidden_layers=2, compress_ratios=(4, 4), num_hash_layers=0,
                                              index_topk=2, sliding_window=4, num_nextn_predict_layers=0)
SEQ = 40  # 10 entries; positions from 11 on see 3 or more, so a tie is possible there
PROMPT = 30  # the end-to-end case: 30 prompt tokens and 11 output tokens feed the same 40 tokens


@pytest.fixture(scope="module")
def load():
    return importlib.import_module("benchmarks.load")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("csa2") / "ckpt", CONFIG, seed=5, tokenizer=False)


@pytest.fixture(scope="module")
def stacked(checkpoint):
    model = dsv4_jax.load_model(checkpoint)
    assert [plan.count for plan in nnx.merge(model.graphdef, model.state).segments_plan] == [2]
    return model


@pytest.fixture(scope="module")
def token_ids() -> np.ndarray:
    return np.random.default_rng(0).integers(3, CONFIG.vocab_size, SEQ)


def dense_forward_picks(model, ids: np.ndarray) -> list[np.ndarray]:
    """The entries each CSA layer of the dense forward attends to, [seq, topk] per layer (-1 =
    none): the attention core receives them; a jitted forward returns what it received."""
    received = []

    def recording_core(q, window_kv, compressed_kv, compressed_idx, sinks, **kwargs):
        if compressed_idx is not None:
            received.append(compressed_idx)
        return dense_attention(q, window_kv, compressed_kv, compressed_idx, sinks, **kwargs)

    def forward(state, ids):
        nnx.merge(model.graphdef, state).hidden_streams(ids, model.options, recording_core)
        return list(received)

    return [np.asarray(p[0]) for p in jax.jit(forward)(model.state, jnp.asarray(ids[None], jnp.int32))]


def counted_margin(layers: list[np.ndarray], t: int) -> float:
    """The margin at position t counted directly: over layers, the smallest gap between the
    k-th and (k+1)-th best visible score over the largest |visible score|."""
    visible = (t + 1) // CONFIG.csa_compress_ratio
    k = CONFIG.index_topk
    if visible <= k:
        return np.inf
    gaps = []
    for scores in layers:
        best = sorted(scores[t, :visible].tolist(), reverse=True)
        gaps.append((best[k - 1] - best[k]) / max(abs(s) for s in best))
    return min(gaps)


def test_margins_come_from_the_scores_the_dense_forward_picks_by(checkpoint, stacked, token_ids):
    layers = indexer_scores(stacked, token_ids)
    picks = dense_forward_picks(dsv4_jax.load_model(checkpoint, stack_layers=False), token_ids)
    assert len(layers) == len(picks) == 2 and layers[0].shape == (SEQ, SEQ // CONFIG.csa_compress_ratio)
    margins = indexer_topk_margins(stacked, token_ids)
    k, compared = CONFIG.index_topk, 0
    for scores, layer_picks in zip(layers, picks):
        for t in range(SEQ):
            visible = (t + 1) // CONFIG.csa_compress_ratio
            ranked = sorted(range(visible), key=lambda j: (-scores[t, j], j))[:k]
            if margins[t] > 1e-4:  # not a near-tie: the two programs must agree
                assert layer_picks[t].tolist() == ranked + [-1] * (k - len(ranked)), (t, scores[t, :visible])
                compared += 1
    assert compared >= 2 * SEQ - 4, compared  # (hardly) any position skipped as a near-tie
    expected = np.array([counted_margin(layers, t) for t in range(SEQ)])
    assert np.isinf(margins[:11]).all() and np.isfinite(margins[11:]).all()
    np.testing.assert_allclose(margins, expected, rtol=1e-12)


def reference_output(token_ids: list[int], gap: float = 0.5) -> CompletionOutput:
    """A reference output whose chosen token leads the runner-up (id 0) by `gap` at every position."""
    logprobs = [{t: Logprob(-1.0, 1), 0: Logprob(-1.0 - gap, 2)} for t in token_ids]
    return CompletionOutput(0, "", list(token_ids), None, logprobs, "length")


def test_the_rule_excuses_near_ties_and_reports_real_differences(load):
    ref = reference_output([5, 6, 7, 8])
    same_logprobs = [-1.0] * 4
    tie_at_2 = [0.3, 0.2, 1e-6, 0.4]
    assert load.compare_stream(ref, [5, 6, 7, 8], same_logprobs, tie_at_2) == load.Comparison()

    # A different token where the indexer's top-k is a near-tie: excused, the rest not compared.
    excused = load.compare_stream(ref, [5, 6, 9, 10], same_logprobs, tie_at_2)
    assert (excused.mismatch, excused.near_tie, excused.diverged_at, excused.uncompared) == (
        None, load.INDEXER_MARGIN, 2, 1)
    # The same difference without a tie there, or with the tie one token later, or no margins.
    for margins in ([0.3, 0.2, 1e-3, 0.4], [0.3, 0.2, 0.1, 1e-6], None):
        mismatch = load.compare_stream(ref, [5, 6, 9, 10], same_logprobs, margins).mismatch
        assert mismatch is not None and mismatch.startswith("token 2: 9 where the reference has 7"), mismatch
    # A logprob off by 0.1 is excused by an indexer near-tie only.
    off = [-1.0, -1.0, -1.1, -1.0]
    assert load.compare_stream(ref, [5, 6, 7, 8], off, tie_at_2).near_tie == load.INDEXER_MARGIN
    assert "logprob -1.1" in load.compare_stream(ref, [5, 6, 7, 8], off, [0.3, 0.2, 0.1, 0.4]).mismatch
    assert load.compare_stream(reference_output([5, 6, 7, 8], gap=1e-4), [5, 6, 7, 8], off).mismatch

    # The output gap rule as before: a different token where top-1 and top-2 are within 1e-3.
    close = reference_output([5, 6, 7, 8], gap=5e-4)
    assert load.compare_stream(close, [5, 6, 9, 10], same_logprobs).near_tie == load.OUTPUT_GAP
    assert load.gap_rule_mismatch(close, [5, 6, 9, 10], same_logprobs) is None
    assert load.gap_rule_mismatch(ref, [5, 6, 9, 10], same_logprobs) is not None
    assert load.compare_stream(ref, [5, 6, 7], same_logprobs[:3]).mismatch == "3 tokens where the reference has 4"

    summary = load.near_tie_summary([load.Comparison(), excused, load.compare_stream(close, [5, 9], [-1.0] * 2)])
    assert summary["diverged at a near-tie"] == {load.OUTPUT_GAP: 1, load.INDEXER_MARGIN: 1}
    assert summary["output tokens not compared"] == 1 + 2
    assert [r.split(":")[0] for r in summary["requests"]] == ["request 1", "request 2"]


def test_the_benchmark_computes_margins_on_the_reference_tokens(load, stacked, token_ids, monkeypatch):
    """End to end on the model's own margins: with the threshold just above the smallest margin
    of the output positions, a difference there is excused and one elsewhere is not."""
    prompt, outputs = token_ids[:PROMPT].tolist(), [*token_ids[PROMPT:].tolist(), 3]  # 11 outputs
    margins = load.output_indexer_margins(stacked, prompt, outputs)
    # Output token i comes from the logits at position PROMPT - 1 + i of the same 40 tokens.
    np.testing.assert_array_equal(margins, indexer_topk_margins(stacked, token_ids)[PROMPT - 1:])
    tie, clear = int(np.argmin(margins)), int(np.argmax(margins))
    monkeypatch.setattr(load, "INDEXER_TIE", margins[tie] * 1.01)
    assert margins[clear] > load.INDEXER_TIE

    ref = reference_output(outputs)
    run = load.LoadRun([prompt] * 3, [], 1.0, 0, 0, {})
    for differs_at in (None, tie, clear):
        ids = list(outputs) if differs_at is None else [*outputs[:differs_at], outputs[differs_at] + 1]
        ids += outputs[len(ids):]
        run.results.append(load.StreamResult(ids, [-1.0] * len(ids), None, 0.0, [], []))
    same, excused, reported = load.compare_with_reference(stacked, run, [ref] * 3)
    assert same == load.Comparison()
    assert (excused.near_tie, excused.diverged_at, excused.mismatch) == (load.INDEXER_MARGIN, tie, None)
    assert reported.mismatch.startswith(f"token {clear}: ") and reported.near_tie is None
