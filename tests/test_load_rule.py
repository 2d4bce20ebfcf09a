"""The load benchmark's comparison rule (benchmarks/load.py) and the top-k margins it uses
(`dsv4_jax.testing.topk_margins_by_kind`: the lightning indexer's and the MoE router's).

The margins are checked on a three-layer CSA model, a hash-routed layer then two top-k-routed
layers stacked (one `nnx.scan`): the scores they come from must rank the entries and the experts
exactly as the dense forward of the same weights, unrolled, picks them (recorded from inside that
forward: the entries its dense attention receives, `select_experts`' inputs and experts), and the
margins must equal a position-by-position count (from the indexer scores; from the gate's own
recorded score + bias). The rule is checked on hand-made outputs (near-ties of each kind excused, a real difference
reported) and end to end on the model's own margins.
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
from dsv4_jax.model import attention, moe
from dsv4_jax.presets import get_config
from dsv4_jax.testing import (
    INDEXER,
    ROUTER,
    indexer_topk_margins,
    router_topk_margins,
    topk_scores,
    write_random_checkpoint,
)

# Three CSA layers, 4 tokens per entry, top-2 of them; layer 0 hash-routed, layers 1 and 2 of one
# kind (top-2 of 8 experts by score + bias), so they stack.
CONFIG = get_config("dsv4-tiny-test").replace(num_hidden_layers=3, compress_ratios=(4, 4, 4), num_hash_layers=1,
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
    model = dsv4_jax.load_model(checkpoint, stack_layers=True)
    assert [plan.count for plan in nnx.merge(model.graphdef, model.state).segments_plan] == [1, 2]
    return model


@pytest.fixture(scope="module")
def token_ids() -> np.ndarray:
    return np.random.default_rng(0).integers(3, CONFIG.vocab_size, SEQ)


@pytest.fixture(scope="module")
def dense_forward_picks(checkpoint, token_ids) -> dict[str, list]:
    """What the dense forward of the unrolled model picks over `token_ids`: "entries", [seq, topk]
    per CSA layer (-1 = none), as its dense attention receives them; "experts", (score + bias
    [seq, experts], experts [seq, k]) per top-k-routed layer, as `select_experts` ranks and returns
    them. A jitted forward returns what it recorded."""
    model = dsv4_jax.load_model(checkpoint, stack_layers=False)
    entries, experts, select, attend = [], [], moe.select_experts, attention.dense_attention

    def recording_attention(q, window_kv, compressed_kv, compressed_idx, sinks, **kwargs):
        if compressed_idx is not None:
            entries.append(compressed_idx[0])
        return attend(q, window_kv, compressed_kv, compressed_idx, sinks, **kwargs)

    def recording_select(scores, bias, top_k):
        picked = select(scores, bias, top_k)
        experts.append((scores + bias, picked[0]))
        return picked

    def forward(state, ids):
        nnx.merge(model.graphdef, state).hidden_streams(ids, model.options)
        return list(entries), list(experts)

    with pytest.MonkeyPatch.context() as patch:  # only while the forward is traced
        patch.setattr(attention, "dense_attention", recording_attention)  # where Attention looks it up
        patch.setattr(moe, "select_experts", recording_select)
        recorded = jax.jit(forward)(model.state, jnp.asarray(token_ids[None], jnp.int32))
    return jax.tree.map(np.asarray, {"entries": recorded[0], "experts": recorded[1]})


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


def test_indexer_margins_come_from_the_scores_the_dense_forward_picks_by(stacked, token_ids, dense_forward_picks):
    layers = topk_scores(stacked, token_ids)[INDEXER]
    picks = dense_forward_picks["entries"]
    assert len(layers) == len(picks) == 3 and layers[0].shape == (SEQ, SEQ // CONFIG.csa_compress_ratio)
    margins = indexer_topk_margins(stacked, token_ids)
    k, compared = CONFIG.index_topk, 0
    for scores, layer_picks in zip(layers, picks):
        for t in range(SEQ):
            visible = (t + 1) // CONFIG.csa_compress_ratio
            ranked = sorted(range(visible), key=lambda j: (-scores[t, j], j))[:k]
            if margins[t] > 1e-4:  # not a near-tie: the two programs must agree
                assert layer_picks[t].tolist() == ranked + [-1] * (k - len(ranked)), (t, scores[t, :visible])
                compared += 1
    assert compared >= 3 * SEQ - 6, compared  # (hardly) any position skipped as a near-tie
    expected = np.array([counted_margin(layers, t) for t in range(SEQ)])
    assert np.isinf(margins[:11]).all() and np.isfinite(margins[11:]).all()
    np.testing.assert_allclose(margins, expected, rtol=1e-12)


def test_router_margins_come_from_what_the_gates_rank(stacked, token_ids, dense_forward_picks):
    """The selection scores of the two top-k-routed layers (the hash-routed one ranks nothing) are
    the score + bias the dense forward's gates rank, their top-k is the experts those gates pick,
    and the margin is a direct count from the gates' own scores."""
    layers = topk_scores(stacked, token_ids)[ROUTER]
    recorded = dense_forward_picks["experts"]
    k, experts = CONFIG.num_experts_per_tok, CONFIG.n_routed_experts
    assert len(layers) == len(recorded) == 2 and layers[0].shape == (SEQ, experts)
    margins = router_topk_margins(stacked, token_ids)
    assert margins.min() > 1e-4  # no near-tie in these tokens: the two programs must pick the same
    counted = np.full(SEQ, np.inf)
    for scores, (ranked_by_gate, picked) in zip(layers, recorded):
        np.testing.assert_allclose(scores, ranked_by_gate, rtol=1e-5, atol=1e-6)
        for t in range(SEQ):
            best = sorted(ranked_by_gate[t].tolist(), reverse=True)
            counted[t] = min(counted[t], (best[k - 1] - best[k]) / max(abs(s) for s in best))
            assert sorted(picked[t]) == sorted(np.argsort(-scores[t], kind="stable")[:k]), t
    np.testing.assert_allclose(margins, counted, rtol=1e-3)

    hash_gate = moe.Gate(CONFIG, hash_routed=True)
    with pytest.raises(ValueError, match="hash-routed gate"):
        hash_gate.selection_scores(jnp.zeros((1, CONFIG.hidden_size)))


def reference_output(token_ids: list[int], gap: float = 0.5) -> CompletionOutput:
    """A reference output whose chosen token leads the runner-up (id 0) by `gap` at every position."""
    logprobs = [{t: Logprob(-1.0, 1), 0: Logprob(-1.0 - gap, 2)} for t in token_ids]
    return CompletionOutput(0, "", list(token_ids), None, logprobs, "length")


CLEAR = [0.3, 0.2, 0.1, 0.4]  # top-k margins far from a tie at every output token
TIE_AT_2 = [0.3, 0.2, 1e-6, 0.4]


def test_the_rule_excuses_near_ties_and_reports_real_differences(load):
    ref = reference_output([5, 6, 7, 8])
    same_logprobs = [-1.0] * 4
    indexer_tie, router_tie = {"indexer": TIE_AT_2, "router": CLEAR}, {"indexer": CLEAR, "router": TIE_AT_2}
    assert load.compare_stream(ref, [5, 6, 7, 8], same_logprobs, indexer_tie) == load.Comparison()

    # A different token where the indexer's or the router's top-k is a near-tie: excused, the rest
    # not compared, the kind reported.
    excused = load.compare_stream(ref, [5, 6, 9, 10], same_logprobs, indexer_tie)
    assert (excused.mismatch, excused.near_tie, excused.diverged_at, excused.uncompared) == (
        None, load.INDEXER_MARGIN, 2, 1)
    by_router = load.compare_stream(ref, [5, 6, 9, 10], same_logprobs, router_tie)
    assert (by_router.mismatch, by_router.near_tie, by_router.diverged_at, by_router.uncompared) == (
        None, load.ROUTER_MARGIN, 2, 1)
    assert "indexer top-k margin 1.0e-01, router top-k margin 1.0e-06" in by_router.detail
    # Both near a tie: the nearer one is the kind.
    both = {"indexer": [0.3, 0.2, 5e-6, 0.4], "router": [0.3, 0.2, 5e-8, 0.4]}
    assert load.compare_stream(ref, [5, 6, 9, 10], same_logprobs, both).near_tie == load.ROUTER_MARGIN
    both = {"indexer": both["router"], "router": both["indexer"]}
    assert load.compare_stream(ref, [5, 6, 9, 10], same_logprobs, both).near_tie == load.INDEXER_MARGIN
    # The same difference without a tie there (1e-3 is above the 1e-5 rule), or with the tie one
    # token later, or no margins.
    later = [0.3, 0.2, 0.1, 1e-6]
    for margins in ({"indexer": [0.3, 0.2, 1e-3, 0.4], "router": [0.3, 0.2, 1e-3, 0.4]},
                    {"indexer": later, "router": CLEAR}, {"indexer": CLEAR, "router": later}, None):
        mismatch = load.compare_stream(ref, [5, 6, 9, 10], same_logprobs, margins).mismatch
        assert mismatch is not None and mismatch.startswith("token 2: 9 where the reference has 7"), mismatch
    # A logprob off by 0.1 is excused by a top-k near-tie only.
    off = [-1.0, -1.0, -1.1, -1.0]
    assert load.compare_stream(ref, [5, 6, 7, 8], off, indexer_tie).near_tie == load.INDEXER_MARGIN
    assert load.compare_stream(ref, [5, 6, 7, 8], off, router_tie).near_tie == load.ROUTER_MARGIN
    clear = {"indexer": CLEAR, "router": CLEAR}
    assert "logprob -1.1" in load.compare_stream(ref, [5, 6, 7, 8], off, clear).mismatch
    assert load.compare_stream(reference_output([5, 6, 7, 8], gap=1e-4), [5, 6, 7, 8], off).mismatch

    # The output gap rule as before: a different token where top-1 and top-2 are within 1e-3.
    close = reference_output([5, 6, 7, 8], gap=5e-4)
    assert load.compare_stream(close, [5, 6, 9, 10], same_logprobs).near_tie == load.OUTPUT_GAP
    assert load.gap_rule_mismatch(close, [5, 6, 9, 10], same_logprobs) is None
    assert load.gap_rule_mismatch(ref, [5, 6, 9, 10], same_logprobs) is not None
    assert load.compare_stream(ref, [5, 6, 7], same_logprobs[:3]).mismatch == "3 tokens where the reference has 4"

    summary = load.near_tie_summary([load.Comparison(), excused, load.compare_stream(close, [5, 9], [-1.0] * 2),
                                     by_router])
    assert summary["diverged at a near-tie"] == {load.OUTPUT_GAP: 1, load.INDEXER_MARGIN: 1, load.ROUTER_MARGIN: 1}
    assert summary["output tokens not compared"] == 1 + 2 + 1
    assert [r.split(":")[0] for r in summary["requests"]] == ["request 1", "request 2", "request 3"]


def test_the_benchmark_computes_margins_on_the_reference_tokens(load, stacked, token_ids, monkeypatch):
    """End to end on the model's own margins: with the threshold just above the smallest router
    margin of the output positions, a difference there is excused as a router near-tie and one
    where both margins are largest is not."""
    prompt, outputs = token_ids[:PROMPT].tolist(), [*token_ids[PROMPT:].tolist(), 3]  # 11 outputs
    margins = load.output_topk_margins(stacked, prompt, outputs)
    # Output token i comes from the logits at position PROMPT - 1 + i of the same 40 tokens.
    np.testing.assert_array_equal(margins["indexer"], indexer_topk_margins(stacked, token_ids)[PROMPT - 1:])
    np.testing.assert_array_equal(margins["router"], router_topk_margins(stacked, token_ids)[PROMPT - 1:])
    router, smallest = margins["router"], np.minimum(margins["indexer"], margins["router"])
    tie, clear = int(np.argmin(router)), int(np.argmax(smallest))
    monkeypatch.setattr(load, "TOPK_TIE", router[tie] * 1.01)
    assert margins["indexer"][tie] > load.TOPK_TIE and smallest[clear] > load.TOPK_TIE

    ref = reference_output(outputs)
    run = load.LoadRun([prompt] * 3, [], 1.0, 0, 0, {})
    for differs_at in (None, tie, clear):
        ids = list(outputs) if differs_at is None else [*outputs[:differs_at], outputs[differs_at] + 1]
        ids += outputs[len(ids):]
        run.results.append(load.StreamResult(ids, [-1.0] * len(ids), None, 0.0, [], []))
    same, excused, reported = load.compare_with_reference(stacked, run, [ref] * 3)
    assert same == load.Comparison()
    assert (excused.near_tie, excused.diverged_at, excused.mismatch) == (load.ROUTER_MARGIN, tie, None)
    assert reported.mismatch.startswith(f"token {clear}: ") and reported.near_tie is None
