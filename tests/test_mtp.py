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
