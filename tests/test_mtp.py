"""MTP parity: our JAX `mtp_logits` against the independent float64 numpy reference
(tests/numpy_reference.py, written from the spec, sections 2-6).

Both sides get the same input: the main model's pre-hc_head streams (computed once by our JAX
model in float32, then widened exactly to float64; our float32 model narrows them back without
loss) and the same `next_ids`, so the comparison isolates the MTP wrapper and its block.
"""

from __future__ import annotations

import numpy as np
import pytest

import dsv4_jax
import numpy_reference as ref  # tests/ is on sys.path (pytest rootdir-relative import)

# Our model runs in float32 (rel. eps ~1.2e-7); the reference in float64. One block deep, with
# O(1) logits and contractions over at most a few hundred terms, float32 rounding accumulates to
# ~1e-6 on the logits. 1e-4 leaves ~100x headroom for that and is still far below the effect of
# any spec mistake (the mutations below move the logits by > 1e-2).
TOLERANCE = 1e-4
MUTATIONS = ("untransposed_comb", "no_enorm", "no_sinks", "neox_rope", "bias_in_weights", "no_inverse_rope")


@pytest.fixture(scope="module")
def mtp_case(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp_ckpt")
    dsv4_jax.testing.write_random_checkpoint(path, "dsv4-tiny-test", seed=0, tokenizer=False)
    model = dsv4_jax.load_model(path)
    cfg = ref.read_config(path)
    weights = ref.read_mtp_weights(path)
    assert cfg["vocab_size"] == 512 and cfg["compress_ratios"][cfg["num_hidden_layers"]] == 0

    rng = np.random.default_rng(1234)
    ids = rng.integers(0, cfg["vocab_size"], size=(2, 13))
    tokens, next_ids = ids[:, :12], ids[:, 1:]  # [2, 12] each; next_ids[t] = token t + 1

    streams = np.asarray(model.hidden_streams(tokens))  # float32 [2, 12, hc_mult, hidden]
    assert streams.shape == (2, 12, cfg["hc_mult"], cfg["hidden_size"])
    assert streams.dtype == np.float32 and np.isfinite(streams).all()
    streams64 = streams.astype(np.float64)  # exact widening; both sides get these values
    ours = np.asarray(model.mtp_logits(streams64, next_ids), dtype=np.float64)
    assert ours.shape == (2, 12, cfg["vocab_size"])

    stats: dict = {}
    expected = ref.mtp_logits(streams64, next_ids, weights, cfg, stats=stats)
    return dict(cfg=cfg, weights=weights, streams=streams64, next_ids=next_ids, ours=ours,
                expected=expected, stats=stats, model=model)


def test_mtp_logits_match_numpy_reference(mtp_case):
    ours, expected = mtp_case["ours"], mtp_case["expected"]
    assert np.isfinite(ours).all()
    # The inputs must exercise the window (seq 12 > sliding_window 8) and produce O(1) logits.
    assert mtp_case["cfg"]["sliding_window"] < ours.shape[1]
    assert 0.1 < np.abs(expected).max() < 100
    # A float32 run can only pick other experts than float64 if the top-k is nearly tied.
    assert mtp_case["stats"]["min_selection_margin"] > 1e-4, mtp_case["stats"]
    diff = np.abs(ours - expected).max()
    print(f"max |ours - reference| = {diff:.3e}")
    assert diff <= TOLERANCE, f"MTP logits differ from the float64 reference by {diff:.3e}"


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_reference_comparison_has_teeth(mtp_case, mutation):
    """Each deliberate spec mistake in the reference moves its logits far beyond the tolerance,
    so agreement within TOLERANCE really pins these details down."""
    c = mtp_case
    mutated = ref.mtp_logits(c["streams"], c["next_ids"], c["weights"], c["cfg"],
                             mutations={mutation})
    gap = np.abs(c["ours"] - mutated).max()
    print(f"{mutation}: max |ours - mutated reference| = {gap:.3e}")
    assert gap > 100 * TOLERANCE, f"mutation {mutation} moves the logits by only {gap:.3e}"


def test_the_drafter_on_the_paged_cache_equals_the_whole_sequence_mtp(mtp_case, tmp_path):
    """The MTP block as a drafter runs on the paged cache (`DeepseekV4.mtp_step`): its own
    sliding-window KV, written at the main step's positions, read by later chunks and decode
    steps. Prefill chunks then decode steps, across several windows, give the whole-sequence
    `mtp_logits` at every position (float32 cache: within 1e-5 x max |logits|)."""
    import jax
    from flax import nnx

    from dsv4_jax.engine.runner import ModelRunner, StepBuckets, StepRow
    from dsv4_jax.testing import paged_layout

    model = mtp_case["model"]
    config = model.config
    assert config.num_nextn_predict_layers == 1
    layout = paged_layout(config, "float32", slots=2, max_model_len=256, num_mtp_layers=1)
    assert config.num_hidden_layers in layout.sliding_layers  # the MTP layer has its own window pool
    runner = ModelRunner(model, layout, buckets=StepBuckets(prefill=((2, 16),), decode=(2,)))
    graphdef, weights_def, options, ctx = runner.graphdef, runner.weights_def, model.options, runner.ctx

    def drafter(weights, cache, streams, next_ids, seqs):
        m = nnx.merge(graphdef, jax.tree.unflatten(weights_def, weights))
        h, cache = m.mtp_step(streams, next_ids, seqs, cache, options, ctx)
        return m.logits_from_streams(h, m.mtp[0]), cache

    drafter = jax.jit(drafter, donate_argnums=1)
    ids = np.random.default_rng(7).integers(0, config.vocab_size, size=45)
    n = 44  # positions 0..43, each with its next token known
    want = np.asarray(model.mtp_logits(model.hidden_streams(ids[None, :n]), ids[None, 1 : n + 1]))[0]
    got, start = [], 0
    for length in [16, 16, *([1] * (n - 32))]:
        rows = [StepRow(0, start, ids[start : start + length].tolist(), [0])]
        bucket, tokens, seqs = runner.build(rows)
        out = runner.run(bucket, tokens, seqs, len(rows))
        next_ids = np.zeros(bucket, np.int32)
        next_ids[0, :length] = ids[start + 1 : start + length + 1]
        logits, runner.cache = drafter(runner.weights, runner.cache, out.streams, next_ids, seqs)
        got.append(np.asarray(logits)[0, :length])
        start += length
    got = np.concatenate(got)
    assert got.shape == want.shape and n > 2 * config.sliding_window
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
