"""The activation memory the KV pools leave room for (dsv4_jax/engine/activations.py): measured from
the compiled programs on the smallest pools, equal to what the programs on the real pools need,
and subtracted from the device's memory before the pools are sized (on a GPU; the GPU's memory is
simulated here). The engine's layout is tests/test_engine.py's, so its programs come from this
lane's persistent cache."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

import dsv4_jax
from dsv4_jax import LLM
from dsv4_jax.engine import llm as llm_module
from dsv4_jax.engine.activations import measure_activations, smallest_pools
from dsv4_jax.engine.runner import ModelRunner
from dsv4_jax.kv_cache.paged import PagedCacheLayout
from dsv4_jax.kv_cache.planner import plan_capacity
from dsv4_jax.presets import get_config
from dsv4_jax.testing import write_random_checkpoint

from conftest import TINY_ENGINE_LAYERS, tiny_engine_args  # tests/ is on sys.path

CONFIG = get_config("dsv4-tiny-test").replace(**TINY_ENGINE_LAYERS)
ARGS = tiny_engine_args()
UTILIZATION = 0.9


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("activations") / "ckpt", CONFIG, seed=5)


@pytest.fixture(scope="module")
def model(checkpoint):
    return dsv4_jax.load_model(checkpoint, dtype=ARGS["dtype"], kv_cache_dtype=ARGS["kv_cache_dtype"])


@pytest.fixture(scope="module")
def engine_layout(model) -> PagedCacheLayout:
    """tests/test_engine.py's pools: max_num_seqs slots, num_gpu_blocks_override compressed blocks."""
    plan = plan_capacity(model.config, model.kv_cache_spec, max_model_len=ARGS["max_model_len"],
                         max_num_seqs=ARGS["max_num_seqs"], block_size=ARGS["block_size"])
    return dataclasses.replace(PagedCacheLayout.from_plan(model.config, plan),
                               num_compressed_blocks=ARGS["num_gpu_blocks_override"])


@pytest.fixture(scope="module")
def activations(model, engine_layout):
    return measure_activations(model, engine_layout, buckets=ARGS["buckets"],
                               attention_backend=model.kv_cache_spec.attention_backend,
                               max_model_len=ARGS["max_model_len"])


def test_step_memory_does_not_grow_with_the_pools(model, engine_layout, gpu_llm):
    """A step gathers from the pools and writes them in place: what it needs beyond them is the
    same for one slot and one compressed block as for the engine's pools. (Prefill steps used to
    copy the whole sliding pool once per layer: their scratch grew by 55% from the smallest pools
    to pools of 8 sequences.)"""
    backend = model.kv_cache_spec.attention_backend
    small = ModelRunner(model, smallest_pools(engine_layout), attention_backend=backend, buckets=ARGS["buckets"])
    large = gpu_llm.engine.runner  # the engine's pools; its programs are compiled already
    assert large.layout == engine_layout
    assert large.layout.num_compressed_blocks >= 10 * small.layout.num_compressed_blocks
    assert large.layout.num_seq_slots >= 4 * small.layout.num_seq_slots
    small_memory, large_memory = small.program_memory(), large.program_memory()
    assert small_memory.keys() == large_memory.keys() == set(small.buckets.all)
    hidden, hc = model.config.hidden_size, model.config.hc_mult
    for (rows, s), measured in small_memory.items():
        other = large_memory[rows, s]
        assert measured.step.temp > 0
        assert abs(measured.step.temp - other.step.temp) <= 0.02 * measured.step.temp, (rows, s)
        # Outputs besides the donated cache: the logits [B, vocab] and streams [B, S, hc, hidden],
        # float32, and the output tuple's table of buffer pointers (8 bytes per output).
        outputs = 4 * rows * (CONFIG.vocab_size + s * hc * hidden)
        assert measured.step.outputs == other.step.outputs
        assert 0 <= measured.step.outputs - outputs <= 8 * 16, (measured.step.outputs, outputs)
        assert measured.logits.shape == (rows, CONFIG.vocab_size)
        assert (measured.scores is None) == (s == 1)
        if s > 1:
            assert measured.scores == other.scores and measured.scores.temp > 0


def test_reserved_bytes_cover_what_may_be_live_at_once(activations):
    """The reservation is the largest step, the previous step's outputs and the larger of prompt
    scoring and sampling; sampling the widest penalised batch holds an edited [B, vocab] copy."""
    hidden, hc, vocab = CONFIG.hidden_size, CONFIG.hc_mult, CONFIG.vocab_size
    outputs = max(4 * b * (vocab + s * hc * hidden) for b, s in ARGS["buckets"].all)
    assert 0 <= activations.step_outputs - outputs <= 8 * 16  # and the output tuple's pointers
    rows = max(b for b, _ in ARGS["buckets"].all)
    assert activations.sampler >= 4 * rows * vocab
    assert activations.step > activations.step_outputs and activations.scores > 0
    assert activations.reserved_bytes == (activations.step + activations.step_outputs
                                          + max(activations.scores, activations.sampler))
    assert "MiB per device" in activations.describe()


def _memory_for(model, activations, layout: PagedCacheLayout) -> int:
    """Device memory whose `UTILIZATION` share holds the weights, the activations and `layout`'s
    pools with half a compressed block to spare: each sequence slot costs its sliding ring and
    compressor state, each compressed block its CSA, indexer and HCA entries (the planner's rule)."""
    weights = sum(leaf.nbytes for leaf in _leaves(model.state))
    pools = plan_capacity(model.config, model.kv_cache_spec, max_model_len=ARGS["max_model_len"],
                          max_num_seqs=1, block_size=ARGS["block_size"]).pools
    per_slot = sum(p.bytes_per_seq for p in pools if p.name in ("sliding", "csa_state", "hca_state"))
    per_block = sum(p.bytes_per_block for p in pools if p.name in ("csa", "indexer", "hca"))
    kv = layout.num_seq_slots * per_slot + layout.num_compressed_blocks * per_block
    return math.ceil((weights + activations.reserved_bytes + kv + per_block // 2) / UTILIZATION)


def _leaves(state):
    import jax

    return jax.tree.leaves(state)


@pytest.fixture(scope="module")
def gpu_memory(model, activations, engine_layout) -> int:
    return _memory_for(model, activations, engine_layout)


@pytest.fixture(scope="module")
def gpu_llm(checkpoint, gpu_memory):
    """tests/test_engine.py's engine, its pools sized from a simulated GPU's memory (no override)."""
    args = {k: v for k, v in ARGS.items() if k != "num_gpu_blocks_override"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_module, "device_memory", lambda device: gpu_memory)
        return LLM(str(checkpoint), **args, gpu_memory_utilization=UTILIZATION)


def test_pools_are_sized_after_the_activations(gpu_llm, gpu_memory, activations, engine_layout):
    """On a GPU the pools get what remains of gpu_memory_utilization x memory after the weights and
    the activations: the engine's layout exactly, for memory sized to hold it."""
    assert gpu_llm.plan.sized_from == "memory"
    assert gpu_llm.plan.reserved_bytes == activations.reserved_bytes
    assert gpu_llm.layout == engine_layout
    weights = sum(leaf.nbytes for leaf in _leaves(gpu_llm.model.state))
    assert weights + activations.reserved_bytes + gpu_llm.cache_bytes <= UTILIZATION * gpu_memory
    out = gpu_llm.generate([{"prompt_token_ids": [0, 5, 6, 7]}],
                           dsv4_jax.SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_activations_that_leave_no_room_are_refused(model, engine_layout, activations):
    """Memory that holds the weights and one sequence, but not the activations too: a ValueError
    naming the flags (the planner raises it before any pool is allocated)."""
    one_seq = dataclasses.replace(engine_layout, num_seq_slots=1, num_compressed_blocks=2)
    memory = _memory_for(model, activations, one_seq) - math.ceil(activations.reserved_bytes / UTILIZATION)
    weights = sum(leaf.nbytes for leaf in _leaves(model.state))
    plan = functools.partial(plan_capacity, model.config, model.kv_cache_spec, max_model_len=ARGS["max_model_len"],
                             device_memory_bytes=memory, gpu_memory_utilization=UTILIZATION, weight_bytes=weights,
                             block_size=ARGS["block_size"], max_num_seqs=1)
    assert plan(reserved_bytes=0).num_seq_slots == 1
    with pytest.raises(ValueError, match=r"reserved for activations.*--max-num-batched-tokens"):
        plan(reserved_bytes=activations.reserved_bytes)
