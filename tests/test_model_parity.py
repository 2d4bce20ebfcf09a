"""Parity of the Flax model with transformers 5.23 `DeepseekV4ForCausalLM` (golden fixtures
written by tools/make_golden.py), and mutation tests showing the comparison has teeth.

Both forward paths are held against the goldens: the whole-sequence forward `model(ids)` (the
model's own reference, dense attention; the mutation tests patch its functions) and the serving
path (`DeepseekV4.step` through a `ModelRunner` on the xla backend: each prompt one prefill chunk
over a fresh float32 paged cache, KV written to and read from the pools as the engine does)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax.model import attention, attention_core, block, compressor, indexer, moe, rope
from dsv4_jax.testing import prefill_logits

# float32 forward vs float32 reference. transformers' float32 logits differ from its own float64
# run by up to 5.9e-6 (manifest cross_checks); ours carry a float32 error of the same size from a
# different op order, so the two can differ by about twice that: 2e-5 (measured: up to 7.0e-6).
# The serving path over a float32 cache rounds nothing either (float32 pools, fp32 references at
# HIGHEST precision): only its op order differs again, so the same bound holds for it (measured:
# up to 1.1e-5, hc4_flash_like's two cases as one 4-row step; its long prompt alone 8.8e-6).
TOLERANCE = 2e-5
# What each deliberate bug must move the logits by at least (O(1) logits; 500x TOLERANCE).
MUTATION_FLOOR = 1e-2
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


_served: dict[str, dict[str, np.ndarray]] = {}


def _served_logits(golden_dir, name, suffix) -> np.ndarray:  # [batch, seq, vocab] float32
    """The serving path's logits of a golden case: every case of config `name` prefilled in one
    step (one bucket per config, so one step compile), each prompt row one chunk from position 0
    in its own slot and blocks of a fresh float32 cache."""
    if name not in _served:
        cases = {s: _case(golden_dir, name, s)[0] for n, s in CASES if n == name}
        rows = prefill_logits(_model(golden_dir, name), [row for ids in cases.values() for row in ids])
        _served[name], at = {}, 0
        for s, ids in cases.items():
            _served[name][s], at = np.stack(rows[at : at + len(ids)]), at + len(ids)
    return _served[name][suffix]


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


@pytest.mark.parametrize("name,suffix", CASES, ids=[n + s for n, s in CASES])
def test_serving_path_logits_match_transformers(golden_dir, name, suffix):
    """The golden prompt as ONE prefill chunk through `DeepseekV4.step` (the engine's path: K=V
    and compressed entries written to the paged pools, attention and the indexer's top-k by the
    xla backend over them) gives transformers' logits at every position."""
    _, expected = _case(golden_dir, name, suffix)
    logits = _served_logits(golden_dir, name, suffix)
    assert logits.dtype == np.float32 and logits.shape == expected.shape
    moved = float(np.max(np.abs(logits - expected)))
    print(f"serving path on {name}{suffix}: max |logits - golden| = {moved:.3g}")
    assert moved <= TOLERANCE


# Each deliberate bug is a replacement of a function the model calls, patched where the model
# looks it up (module globals are read when the forward is traced), on a fixture where it can act
# (a 2x2 doubly-stochastic comb is symmetric, so the comb mutation needs hc_mult >= 3; -1 picks
# need fewer visible entries than top-k).
def _rotate_half_rope(x, cos, sin, *, inverse=False, heads_axis=False):
    """Rotate-half (GPT-NeoX) RoPE: pairs (x[i], x[i + half]) instead of (x[2i], x[2i + 1])."""
    half = cos.shape[-1]
    if heads_axis:
        cos, sin = cos[..., None, :], sin[..., None, :]
    if inverse:
        sin = -sin
    nope, rope = x[..., : -2 * half], x[..., -2 * half :].astype(jnp.float32)
    a, b = rope[..., :half], rope[..., half:]
    rotated = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)


def _no_sinks(patch):  # the softmax helper gets sink logits of -inf: no probability mass
    softmax = attention_core._softmax_with_sink

    def without_sinks(logits, kv, extra, extra_kv, sinks):
        return softmax(logits, kv, extra, extra_kv, jnp.full_like(sinks, -jnp.inf))

    patch(attention_core, "_softmax_with_sink", without_sinks)


def _neox_rope(patch):  # every RoPE site of the model rotates halves instead of pairs
    for module in (attention, compressor, indexer):
        patch(module, "apply_rope", _rotate_half_rope)


def _untransposed_comb(patch):  # hc_post mixes with comb[k, j] instead of comb[j, k]
    post = block.hc_post
    patch(block, "hc_post", lambda out, streams, p, comb: post(out, streams, p, jnp.swapaxes(comb, -1, -2)))


def _no_inverse_rope(patch):  # the attention output keeps its RoPE rotation
    rotate = attention.apply_rope

    def forward_only(x, cos, sin, *, inverse=False, heads_axis=False):
        return x if inverse else rotate(x, cos, sin, heads_axis=heads_axis)

    patch(attention, "apply_rope", forward_only)


def _no_yarn(patch):  # compressed layers' RoPE without the YaRN blend
    frequencies = rope.inverse_frequencies
    patch(rope, "inverse_frequencies", lambda rope_dim, base, yarn: frequencies(rope_dim, base, None))


def _no_csa_overlap(patch):  # each CSA entry pools only its own window, through the second half
    patch(compressor, "overlapping_windows", lambda kv, score, d: (kv[:, 1:, :, d:], score[:, 1:, :, d:]))


def _bias_in_weights(patch):  # the selection bias also weighs the chosen experts
    select = moe.select_experts
    patch(moe, "select_experts", lambda scores, bias, k: select(scores + bias, jnp.zeros_like(bias), k))


def _minus_one_as_row_zero(patch):  # an empty top-k slot reads compressed row 0
    topk = indexer.select_visible_topk
    patch(indexer, "select_visible_topk", lambda *args: jnp.maximum(topk(*args), 0))


MUTATIONS = [
    (_no_sinks, "hc4_sliding_only", ""),
    (_neox_rope, "hc4_sliding_only", ""),
    (_untransposed_comb, "hc4_sliding_only", ""),
    (_no_inverse_rope, "hc4_sliding_only", ""),
    (_no_yarn, "hc3_long_yarn", ""),
    (_no_csa_overlap, "hc2_short_noyarn", ""),
    (_bias_in_weights, "hc4_sliding_only", ""),
    (_minus_one_as_row_zero, "hc2_short_noyarn", ""),
]


@pytest.mark.parametrize("mutate,name,suffix", MUTATIONS, ids=[m.__name__[1:] for m, _, _ in MUTATIONS])
def test_each_mutation_breaks_parity(golden_dir, monkeypatch, mutate, name, suffix):
    ids, expected = _case(golden_dir, name, suffix)
    assert np.max(np.abs(np.asarray(_model(golden_dir, name)(ids)) - expected)) <= TOLERANCE
    mutate(monkeypatch.setattr)
    # A fresh model after patching: load_model's CausalLM jits new closures per instance, so the
    # patched functions are traced; the cached models above keep their own unpatched traces.
    mutated = np.asarray(dsv4_jax.load_model(golden_dir / name / "checkpoint")(ids))
    moved = np.max(np.abs(mutated - expected))
    print(f"{mutate.__name__[1:]} on {name}{suffix}: max |delta logits| = {moved:.3g}")
    assert moved > MUTATION_FLOOR


def test_manifest_records_the_reference(golden_dir):
    manifest = json.loads((golden_dir / "manifest.json").read_text())
    assert manifest["versions"]["transformers"] == "5.23.0"
    assert {c["name"] for c in manifest["configs"]} >= {n for n, _ in CASES}
