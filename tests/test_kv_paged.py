"""Paged cache state: abstract description, sharded materialisation, donation, slot arithmetic."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from dsv4_jax.kv_cache import (
    NO_BLOCK,
    Bf16Rows,
    Float32Rows,
    Fp8DsMlaPlanes,
    IndexerBf16Rows,
    IndexerFloat32Rows,
    IndexerFp8Planes,
    PagedCacheLayout,
    abstract_paged_cache,
    cache_nbytes,
    compressed_slots,
    init_paged_cache,
    paged_cache_shardings,
    plan_capacity,
    read_indexer,
    read_kv,
    reset_slots_donated,
    resolve_kv_cache,
    sliding_slots,
    write_kv_reference,
)
from dsv4_jax.kv_cache.paged import indexer_planes, kv_planes
from dsv4_jax.model import kv_rounding
from dsv4_jax.presets import get_config

TINY = get_config("dsv4-tiny-test")  # head 96 (64 nope + 32 rope), window 8, layers: sliding, CSA, HCA, CSA
FP8 = resolve_kv_cache("fp8", "cpu", None, config=TINY)
BF16 = resolve_kv_cache("auto", "cpu", None, config=TINY)
FP32 = resolve_kv_cache("float32", "cpu", None, config=TINY)


def layout(spec, slots=2, max_model_len=512):
    plan = plan_capacity(TINY, spec, max_model_len=max_model_len, max_num_seqs=slots, block_size=128)
    return PagedCacheLayout.from_plan(TINY, plan), plan


def test_abstract_description_matches_the_plan():
    lay, plan = layout(FP8)
    assert (lay.sliding_layers, lay.csa_layers, lay.hca_layers) == ((0, 1, 2, 3), (1, 3), (2,))
    assert lay.sliding_ring == math.ceil(8 / 128) + 1 == 2  # never more window blocks per sequence
    assert (lay.num_compressed_blocks, lay.max_blocks_per_seq) == (math.ceil(2 * 512 / 128) + 2, 4)
    a = abstract_paged_cache(lay)
    assert isinstance(a.sliding.kv, Fp8DsMlaPlanes) and isinstance(a.compressed.indexer, IndexerFp8Planes)
    assert a.sliding.kv.nope.shape == (4, 4, 128, 64) and a.sliding.kv.nope.dtype == jnp.float8_e4m3fn
    assert a.sliding.kv.rope.shape == (4, 4, 128, 32) and a.sliding.kv.scales.shape == (4, 4, 128, 8)
    assert a.compressed.csa.nope.shape == (2, 10, 32, 64)  # 128 positions / r=4 = 32 entries per block
    assert a.compressed.hca.nope.shape == (1, 10, 1, 64)  # 128 / 128 = 1 entry per block
    assert a.compressed.indexer.keys.shape == (2, 10, 32, 64) and a.compressed.indexer.scales.dtype == jnp.float32
    assert a.sliding.block_table.shape == (2, 2) and a.compressed.block_table.shape == (2, 4)
    assert a.csa_state.kv.shape == (2, 2, 8, 192)  # [CSA layers, slots, 2r, 2d]
    assert a.csa_indexer_state.kv.shape == (2, 2, 8, 128) and a.hca_state.score.shape == (1, 2, 128, 96)
    tables = sum(math.prod(t.shape) * 4 for t in (a.sliding.block_table, a.compressed.block_table))
    assert cache_nbytes(a) - tables == plan.kv_budget_bytes  # the planner counts exactly these planes

    bf16 = abstract_paged_cache(layout(BF16)[0])
    assert isinstance(bf16.sliding.kv, Bf16Rows) and bf16.sliding.kv.rows.shape == (4, 4, 128, 96)
    assert isinstance(bf16.compressed.indexer, IndexerBf16Rows)

    lay32, plan32 = layout(FP32)
    assert (lay32.kv_cache_dtype, lay32.indexer_dtype) == ("float32", "float32")
    f32 = abstract_paged_cache(lay32)
    for planes in (f32.sliding.kv, f32.compressed.csa, f32.compressed.hca):
        assert isinstance(planes, Float32Rows) and planes.rows.dtype == jnp.float32
    assert f32.sliding.kv.rows.shape == (4, 4, 128, 96) and f32.compressed.hca.rows.shape == (1, 10, 1, 96)
    assert isinstance(f32.compressed.indexer, IndexerFloat32Rows)
    assert f32.compressed.indexer.keys.shape == (2, 10, 32, 64) and f32.compressed.indexer.keys.dtype == jnp.float32
    assert cache_nbytes(f32) - tables == plan32.kv_budget_bytes  # 4 x head_dim / 4 x index_head_dim per unit


def test_materialised_in_one_jit_with_shardings_and_donated():
    lay, _ = layout(FP8)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    shardings = paged_cache_shardings(lay, mesh, "data")
    abstract = abstract_paged_cache(lay, shardings)
    assert abstract.compressed.csa.nope.sharding.spec == P(None, "data", None, None)
    assert abstract.compressed.block_table.sharding.spec == P("data", None)
    assert abstract.hca_state.kv.sharding.spec == P(None, "data", None, None)

    cache = init_paged_cache(lay, mesh, "data")
    leaves = jax.tree.leaves(cache)
    assert [(x.shape, x.dtype) for x in leaves] == [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]
    assert all(x.sharding.spec == s.sharding.spec for x, s in zip(leaves, jax.tree.leaves(abstract)))
    assert (np.asarray(cache.sliding.block_table) == NO_BLOCK).all()
    assert (np.asarray(cache.csa_state.score) == -np.inf).all() and not np.asarray(cache.csa_state.kv).any()

    table = cache.compressed.block_table.at[:, :2].set(jnp.array([[3, 4], [5, 6]], jnp.int32))
    state = cache.csa_state.kv.at[...].set(1.0)
    cache = cache.__class__(
        cache.sliding, cache.compressed.__class__(cache.compressed.csa, cache.compressed.indexer,
                                                  cache.compressed.hca, table),
        cache.csa_state.__class__(state, cache.csa_state.score), cache.csa_indexer_state, cache.hca_state,
    )
    old = cache.compressed.block_table
    cache = reset_slots_donated(cache, jnp.array([1, -1], jnp.int32))
    assert old.is_deleted()  # donated through jit: updated in place
    np.testing.assert_array_equal(cache.compressed.block_table, [[3, 4, -1, -1], [-1, -1, -1, -1]])
    assert (np.asarray(cache.csa_state.kv)[:, 0] == 1).all() and not np.asarray(cache.csa_state.kv)[:, 1].any()
    assert cache.compressed.csa.nope.sharding.spec == P(None, "data", None, None)


def test_sharding_rejects_indivisible_pools():
    lay, _ = layout(FP8, slots=3)
    with pytest.raises(ValueError, match="data-parallel"):
        paged_cache_shardings(lay, _FakeMesh({"data": 2}), "data")
    with pytest.raises(ValueError, match="axis"):
        paged_cache_shardings(lay, _FakeMesh({"data": 1}), "dp")


class _FakeMesh:
    def __init__(self, shape):
        self.shape, self.axis_names = shape, tuple(shape)


def test_slot_arithmetic():
    ring = jnp.array([7, 2], jnp.int32)  # a sliding ring of 2 blocks of 128 positions
    np.testing.assert_array_equal(sliding_slots(ring, jnp.array([0, 127, 128, 255, 256, 300]), 128),
                                  [7 * 128, 7 * 128 + 127, 2 * 128, 2 * 128 + 127, 7 * 128, 7 * 128 + 44])
    np.testing.assert_array_equal(sliding_slots(jnp.array([-1, 2]), jnp.array([5, 130]), 128), [-1, 2 * 128 + 2])
    table = jnp.array([4, 9, -1], jnp.int32)  # CSA entries, 32 per block
    np.testing.assert_array_equal(compressed_slots(table, jnp.array([0, 31, 32, 70, 96]), 32),
                                  [4 * 32, 4 * 32 + 31, 9 * 32, -1, -1])


@pytest.mark.parametrize("spec", [FP8, BF16, FP32], ids=["fp8_ds_mla", "bf16", "float32"])
def test_write_read_round_trip(spec):
    lay, _ = layout(spec)
    cache = init_paged_cache(lay)
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.normal(size=(5, 96)) * 3, jnp.float32)
    keys = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)
    slots = jnp.array([0, 33, 319, -1, 64], jnp.int32)  # -1: padding, skipped

    @jax.jit
    def step(csa, indexer):
        csa = write_kv_reference(csa, kv, slots, 1)
        indexer = write_kv_reference(indexer, keys, slots, 1)
        return csa, indexer, read_kv(csa, slots, 1), read_indexer(indexer, slots, 1)

    csa, indexer, back, back_keys = step(cache.compressed.csa, cache.compressed.indexer)
    assert type(csa) is type(cache.compressed.csa) and type(indexer) is type(cache.compressed.indexer)
    valid = np.asarray(slots) >= 0
    if spec is FP8:
        want, want_keys = jax.jit(
            lambda a, b: (kv_rounding.kv_cache_round_trip(a, 32), kv_rounding.indexer_key_round_trip(b))
        )(kv, keys)
    elif spec is BF16:
        want = kv.astype(jnp.bfloat16).astype(jnp.float32)
        want_keys = keys.astype(jnp.bfloat16).astype(jnp.float32)
    else:  # float32 rows and keys are stored and read exactly
        want, want_keys = kv, keys
    np.testing.assert_array_equal(np.asarray(back)[valid], np.asarray(want)[valid])
    np.testing.assert_array_equal(np.asarray(back_keys)[valid], np.asarray(want_keys)[valid])
    assert not np.asarray(back)[~valid].any()
    other = read_kv(csa, slots, 0)  # layer 0 of the pool was not written
    assert not np.asarray(other).any()


def test_pool_planes_name_the_unknown_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' has no pool planes; allowed: 'fp8_ds_mla', "
                                         "'bfloat16', 'float32'"):
        kv_planes("fp8", (1, 2, 4), 96, 32)
    with pytest.raises(ValueError, match="indexer_dtype 'int8' has no pool planes; allowed: 'fp8', 'bfloat16', "
                                         "'float32'"):
        indexer_planes("int8", (1, 2, 4), 64)


def test_the_sliding_ring_never_exceeds_what_a_sequence_spans_and_the_pool_holds_every_ring():
    from dsv4_jax.kv_cache.paged import PagedCacheLayout
    from dsv4_jax.kv_cache.planner import plan_capacity
    from dsv4_jax.kv_cache.resolver import resolve_kv_cache
    from dsv4_jax.presets import get_config

    config = get_config("dsv4-tiny-test")
    spec = resolve_kv_cache("float32", device_kind="cpu", config=config)
    for max_model_len, ring in ((128, 1), (512, 2)):  # window 8, blocks of 128: ceil(8/128) + 1 = 2
        plan = plan_capacity(config, spec, max_model_len=max_model_len, max_num_seqs=4, block_size=128)
        layout = PagedCacheLayout.from_plan(config, plan)
        assert layout.sliding_ring == ring and layout.num_sliding_blocks == 4 * ring
    with pytest.raises(ValueError, match="num_sliding_blocks"):
        PagedCacheLayout.build(config, spec, max_model_len=512, num_seq_slots=4, num_sliding_blocks=7, block_size=128)
