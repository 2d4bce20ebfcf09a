"""Parity of the Flax model with transformers 5.23 `DeepseekV4ForCausalLM` (golden fixtures
written by tools/make_golden.py), and mutation tests showing the comparison has teeth."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dsv4_jax
from dsv4_jax.model.options import Ablations

# float32 forward vs float32 reference: the fixtures' own float32-vs-float64 gap is < 1e-5.
TOLERANCE = 2e-4
CASES = [
    ("hc4_flash_like", ""),
    ("hc4_flash_like", "_short"),
    ("hc2_short_noyarn", ""),
    ("hc3_long_yarn", ""),
    ("hc4_sliding_only", ""),
]

_models: dict[str, object] = {}


def _model(golden_dir, name):
    if name not in _models:
        _models[name] = dsv4_jax.load_model(golden_dir / name / "checkpoint")
    return _models[name]


def _case(golden_dir, name, suffix):
    d = golden_dir / name
    return np.load(d / f"input_ids{suffix}.npy"), np.load(d / f"logits{suffix}.npy")


def test_fixtures_cover_the_required_features(golden_dir):
    """The fixture set as a whole covers what the parity claim is about."""
    configs = {c: _model(golden_dir, c).config for c, _ in CASES}
    types = {t for c in configs.values() for t in c.layer_types}
    assert types == {"sliding", "csa", "hca"}
    assert {c.hc_mult for c in configs.values()} >= {2, 3, 4}
    assert any(c.num_hash_layers for c in configs.values())
    assert any(c.num_hash_layers < c.num_hidden_layers for c in configs.values())
    assert any(c.rope_scaling.enabled for c in configs.values())
    assert all(c.index_n_heads >= 8 for c in configs.values())
    ids, _ = _case(golden_dir, "hc3_long_yarn", "")
    cfg = configs["hc3_long_yarn"]
    assert ids.shape[1] // cfg.csa_compress_ratio > cfg.index_topk  # the indexer prunes
    hca = [cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers) if cfg.layer_type(i) == "hca"]
    assert ids.shape[1] // hca[0] >= 2 and ids.shape[0] > 1
    short, _ = _case(golden_dir, "hc4_flash_like", "_short")
    assert short.shape[1] < configs["hc4_flash_like"].sliding_window


@pytest.mark.parametrize("name,suffix", CASES, ids=[n + s for n, s in CASES])
def test_logits_match_transformers(golden_dir, name, suffix):
    model = _model(golden_dir, name)
    ids, expected = _case(golden_dir, name, suffix)
    logits = np.asarray(model(ids))
    assert logits.dtype == np.float32 and logits.shape == expected.shape
    assert np.max(np.abs(logits - expected)) <= TOLERANCE


# Each deliberate bug, on a fixture where it can act (a 2x2 doubly-stochastic comb is symmetric,
# so the comb mutation needs hc_mult >= 3; -1 picks need fewer visible entries than top-k).
MUTATIONS = [
    ("no_sinks", "hc4_sliding_only", ""),
    ("neox_rope", "hc4_sliding_only", ""),
    ("untransposed_comb", "hc4_sliding_only", ""),
    ("no_inverse_rope", "hc4_sliding_only", ""),
    ("no_yarn", "hc3_long_yarn", ""),
    ("no_csa_overlap", "hc2_short_noyarn", ""),
    ("bias_in_weights", "hc4_sliding_only", ""),
    ("minus_one_as_row_zero", "hc2_short_noyarn", ""),
]


@pytest.mark.parametrize("mutation,name,suffix", MUTATIONS, ids=[m for m, _, _ in MUTATIONS])
def test_each_mutation_breaks_parity(golden_dir, mutation, name, suffix):
    model = _model(golden_dir, name)
    ids, expected = _case(golden_dir, name, suffix)
    mutated = np.asarray(model(ids, ablations=Ablations(**{mutation: True})))
    moved = np.max(np.abs(mutated - expected))
    print(f"{mutation} on {name}{suffix}: max |delta logits| = {moved:.3g}")
    assert moved > 100 * TOLERANCE


def test_manifest_records_the_reference(golden_dir):
    manifest = json.loads((golden_dir / "manifest.json").read_text())
    assert manifest["versions"]["transformers"] == "5.23.0"
    assert {c["name"] for c in manifest["configs"]} >= {n for n, _ in CASES}
