"""The model's attention through the KV-cache backends (`pallas_kernels.backend`): the paged
adapter against the dense reference at the core level, the whole model on the fp8_ds_mla
Pallas kernels (interpret mode on CPU) against the dense model with KV rounding, and the whole
model on the float32 KV cache (xla backend) against the dense float32 model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax.model import kv_rounding
from dsv4_jax.model.attention_core import dense_attention
from dsv4_jax.model.indexer import select_visible_topk
from dsv4_jax.model.paged_core import PagedAttentionCore
from dsv4_jax.testing import write_random_checkpoint

HEADS, HEAD_DIM, ROPE, SEQ, WINDOW = 4, 96, 32, 24, 8


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("tiny") / "m", "dsv4-tiny-test", seed=0, tokenizer=False, include_mtp=False
    )


@pytest.fixture(scope="module")
def every_kind_checkpoint(tmp_path_factory):
    """(checkpoint path, token ids [2, 40]) of a model where every attention kind acts within 40
    tokens: HCA at ratio 16 has entries from position 15 on (ratio 128 would have none).
    index_topk = all CSA entries, so the indexer keeps every visible one and a rounding of its
    scores cannot flip a selection; hash routing on every layer, so expert choice cannot flip
    either: the logits move smoothly with the attention error."""
    seq, csa_ratio, hca_ratio = 40, 4, 16
    config = dsv4_jax.presets.dsv4_tiny_test().replace(
        compress_ratios=(0, csa_ratio, hca_ratio, csa_ratio, 0), num_hash_layers=4, index_topk=seq // csa_ratio
    )
    assert config.layer_types == ("sliding", "csa", "hca", "csa") and seq // hca_ratio == 2
    path = write_random_checkpoint(
        tmp_path_factory.mktemp("every_kind") / "m", config, seed=1, tokenizer=False, include_mtp=False
    )
    return path, np.random.default_rng(0).integers(0, 512, (2, seq)).astype(np.int32)


def _inputs(ratio: int, csa: bool):
    keys = jax.random.split(jax.random.key(0), 5)
    # q already on the bf16 grid (the kernels' dot operand) and K=V on the fp8_ds_mla grid (as the
    # model with kv_cache_rounding gives them), so the only rounding left is the kernel's bf16
    # probabilities in the P @ V dot.
    q = jax.random.normal(keys[0], (2, SEQ, HEADS, HEAD_DIM)).astype(jnp.bfloat16).astype(jnp.float32)
    kv = kv_rounding.kv_cache_round_trip(jax.random.normal(keys[1], (2, SEQ, HEAD_DIM)), ROPE)
    compressed = kv_rounding.kv_cache_round_trip(jax.random.normal(keys[2], (2, SEQ // ratio, HEAD_DIM)), ROPE)
    idx = select_visible_topk(jax.random.normal(keys[3], (2, SEQ, SEQ // ratio)), ratio, 3) if csa else None
    sinks = jax.random.normal(keys[4], (HEADS,))
    return q, kv, compressed, idx, sinks


@pytest.mark.parametrize(
    "backend,layer",
    [("pallas_fp8_ds_mla", "csa"), ("pallas_fp8_ds_mla", "hca"), ("pallas_bf16", "csa"), ("xla", "hca")],
)
def test_paged_core_matches_the_dense_reference(backend, layer):
    ratio = 4 if layer == "csa" else 8
    q, kv, compressed, idx, sinks = _inputs(ratio, csa=layer == "csa")
    want = dense_attention(q, kv, compressed, idx, sinks, window=WINDOW, ratio=ratio)
    core = PagedAttentionCore(backend, ROPE, block_size=4)  # several pool blocks per sequence
    got = jax.jit(lambda *a: core(*a, window=WINDOW, ratio=ratio))(q, kv, compressed, idx, sinks)
    # Probabilities rounded to bf16 (relative 2^-9) in a convex combination of rows: |error| <=
    # 2^-9 * max|kv|; twice that for fp32 summation order.
    # The xla backend is the kernels' pure-JAX reference: the same fp32 math up to summation order.
    scale = max(float(jnp.max(jnp.abs(kv))), float(jnp.max(jnp.abs(compressed))))
    bound = (1e-5 if backend == "xla" else 2.0**-8) * scale
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=bound, rtol=0)


def test_unknown_backend_is_rejected_at_load(tiny_checkpoint):
    with pytest.raises(ValueError, match="unknown attention backend"):
        dsv4_jax.load_model(tiny_checkpoint, attention_backend="flashmla")


def test_model_on_the_fp8_pallas_kernels_tracks_the_dense_model(every_kind_checkpoint):
    path, ids = every_kind_checkpoint
    dense = np.asarray(dsv4_jax.load_model(path, kv_cache_rounding=True)(ids))
    paged = np.asarray(dsv4_jax.load_model(path, kv_cache_rounding=True, attention_backend="pallas_fp8_ds_mla")(ids))
    # K = V are on the fp8_ds_mla grid on both sides (kv_cache_rounding), so the kernels differ from
    # the dense core only by rounding q and the probabilities to bf16 (relative 2^-8 each, see
    # above): 2 roundings per layer, 4 layers, 8 in all, each moving the logits by at most about
    # 2^-8 of their largest magnitude. Measured: 3.2 x 2^-8 x max|logits| (0.052 against 0.13).
    moved, bound = np.max(np.abs(paged - dense)), 8 * 2.0**-8 * np.max(np.abs(dense))
    assert moved <= bound, (moved, bound)


def test_float32_kv_cache_equals_the_dense_model(every_kind_checkpoint):
    path, ids = every_kind_checkpoint
    dense = np.asarray(dsv4_jax.load_model(path)(ids))  # no KV cache: the dense float32 reference
    model = dsv4_jax.load_model(path, kv_cache_dtype="float32")
    spec = model.kv_cache_spec
    assert (spec.kv_cache_dtype, spec.indexer_dtype, spec.attention_backend) == ("float32", "float32", "xla")
    assert (model.core.backend_name, model.core.kv_cache_dtype) == ("xla", "float32")
    assert not model.options.kv_cache_rounding
    exact = np.asarray(model(ids))
    # float32 pools, and q and the window rows unrounded: the dense core's fp32 math up to summation
    # order (measured 1e-6 x max|logits|). A bf16 rounding anywhere on the way (q, window rows or
    # pool rows: 2^-9 relative) moves the logits by about 3e-3 x max|logits|.
    moved, bound = np.max(np.abs(exact - dense)), 1e-5 * np.max(np.abs(dense))
    assert moved <= bound, (moved, bound)


def test_kv_cache_dtype_resolves_the_layout_and_backend_for_this_device(tiny_checkpoint, caplog):
    import logging

    path = tiny_checkpoint
    with caplog.at_level(logging.INFO):
        model = dsv4_jax.load_model(path, kv_cache_dtype="fp8")  # CPU: fp8 is emulated on xla
    assert model.kv_cache_spec.kv_cache_dtype == "fp8_ds_mla"
    assert model.kv_cache_spec.attention_backend == "xla" and model.core.backend_name == "xla"
    assert model.options.kv_cache_rounding
    assert "Using DeepSeek's fp8_ds_mla KV cache format." in caplog.messages
    auto = dsv4_jax.load_model(path, kv_cache_dtype="auto")
    assert auto.kv_cache_spec.kv_cache_dtype == "bfloat16" and not auto.options.kv_cache_rounding
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        dsv4_jax.load_model(path, kv_cache_dtype="int4")
