"""The activation memory the KV pools leave room for (dsv4_jax/engine/activations.py), and steps that
update the pools in place. On a GPU the builder (dsv4_jax/engine/builder.py) compiles the largest
buckets for the smallest pools and reserves what XLA's buffer assignment says they need before it
sizes the pools; the warmed-up programs are then checked against that reservation, and pools
planned again where they need more. The GPU's memory is simulated here. The engine's layout is
tests/test_engine.py's, so its programs come from this lane's persistent cache."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import types

import jax
import pytest

import dsv4_jax
from dsv4_jax import LLM
from dsv4_jax.engine import activations as activations_module
from dsv4_jax.engine import builder
from dsv4_jax.engine.activations import engine_activations, measure_activations
from dsv4_jax.engine.compiles import ProgramMemory
from dsv4_jax.engine.runner import ModelRunner
from dsv4_jax.kv_cache import KVCacheSpec, resolve_for_device
from dsv4_jax.kv_cache.paged import PagedCacheLayout
from dsv4_jax.kv_cache.planner import plan_capacity
from dsv4_jax.presets import get_config
from dsv4_jax.testing import write_random_checkpoint

from conftest import TINY_ENGINE_LAYERS, tiny_engine_args  # tests/ is on sys.path

CONFIG = get_config("dsv4-tiny-test").replace(**TINY_ENGINE_LAYERS)
ARGS = tiny_engine_args()
UTILIZATION = 0.9
# XLA's buffer assignment of the same program for other pool sizes differs by a few KB of packing
# (at most 6 KB seen); a pool copied whole is far more (the HCA pool: 6144 bytes per block).
PACKING_NOISE = 16 * 1024


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("activations") / "ckpt", CONFIG, seed=5)


@pytest.fixture(scope="module")
def model(checkpoint):
    return dsv4_jax.load_model(checkpoint, dtype=ARGS["dtype"])


@pytest.fixture(scope="module")
def spec() -> KVCacheSpec:
    """The engine's KV cache spec for ARGS, resolved as `LLM` resolves it."""
    return resolve_for_device(ARGS["kv_cache_dtype"], jax.devices()[0], config=CONFIG, log=False)


@pytest.fixture(scope="module")
def engine_layout(model, spec) -> PagedCacheLayout:
    """tests/test_engine.py's pools: max_num_seqs slots, num_gpu_blocks_override compressed blocks."""
    plan = plan_capacity(model.config, spec, max_model_len=ARGS["max_model_len"],
                         max_num_seqs=ARGS["max_num_seqs"], block_size=ARGS["block_size"])
    return dataclasses.replace(PagedCacheLayout.from_plan(model.config, plan),
                               num_compressed_blocks=ARGS["num_gpu_blocks_override"])


@pytest.fixture(scope="module")
def activations(checkpoint, engine_layout):
    """What tests/test_engine.py's engine needs (its arguments, its layout on CPU's pools), from
    the executables its warm-up built: the programs are that engine's, compiled once in this lane."""
    llm = LLM(str(checkpoint), **ARGS)
    assert llm.layout == engine_layout
    return engine_activations(llm.engine)


def _weight_bytes(model) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(model.state))


def test_steps_update_the_pools_in_place(model, spec, engine_layout):
    """A step's scratch is the same for one sequence slot and one sequence's compressed blocks (the
    pools the builder measures on) as for 64 slots and 400 blocks (pools given as shapes only): no
    step copies a pool, so the largest buckets measured on the smallest pools give what every
    bucket needs on any. Prefill steps used to copy the whole HCA pool (XLA forwarded its write
    into the attention's gather), and on the built-in dsv4-tiny the whole sliding pool once per
    layer (the ring write did not wait for the attention's read). A float8 cache still copies its
    planes on XLA:CPU (docs/kv_cache.md)."""
    backend = spec.attention_backend
    smallest = dataclasses.replace(engine_layout, num_seq_slots=1, num_sliding_blocks=engine_layout.sliding_ring,
                                   num_compressed_blocks=engine_layout.max_blocks_per_seq + 1)
    largest = dataclasses.replace(engine_layout, num_seq_slots=64, num_sliding_blocks=64 * engine_layout.sliding_ring,
                                  num_compressed_blocks=400)
    buckets = builder.largest_buckets(ARGS["buckets"])  # as the builder measures (and compiles once here)
    small, large = (ModelRunner(model, layout, attention_backend=backend, buckets=buckets,
                                allocate_cache=False).program_memory(scoring=False)
                    for layout in (smallest, largest))
    assert small.keys() == large.keys() == {(4, 32), (4, 1)}
    hidden, hc = model.config.hidden_size, model.config.hc_mult
    for (rows, s), measured in small.items():
        other = large[rows, s].step
        assert 0 < measured.step.temp and other.temp <= measured.step.temp + PACKING_NOISE, (rows, s)
        # Outputs besides the donated cache: the logits [B, vocab] and streams [B, S, hc, hidden],
        # float32, and the output tuple's table of buffer pointers (8 bytes per output).
        outputs = 4 * rows * (CONFIG.vocab_size + s * hc * hidden)
        assert measured.step.outputs == other.outputs
        assert 0 <= measured.step.outputs - outputs <= 8 * 16, (measured.step.outputs, outputs)
        assert measured.logits.shape == (rows, CONFIG.vocab_size) and measured.scores is None


def test_prefill_writes_the_sliding_ring_in_place():
    """The built-in dsv4-tiny (real vocabulary, window 8): a prefill step's scratch does not grow
    from one slot to 32. Before its ring write waited for the attention's read, XLA copied the
    whole sliding pool once per layer: 5.4 MB with one slot, 8.2 MB with 8."""
    from dsv4_jax.weights.builtin import builtin_model_dir
    from dsv4_jax.engine.runner import StepBuckets

    tiny = dsv4_jax.load_model(builtin_model_dir(), dtype="float32")
    tiny_spec = resolve_for_device("float32", jax.devices()[0], config=tiny.config, log=False)
    plan = plan_capacity(tiny.config, tiny_spec, max_model_len=512, max_num_seqs=32, block_size=128)
    layout = PagedCacheLayout.from_plan(tiny.config, plan)
    smallest = dataclasses.replace(layout, num_seq_slots=1, num_sliding_blocks=layout.sliding_ring,
                                   num_compressed_blocks=1)
    def prefill_scratch(lay) -> int:  # the (2, 32) step alone (its decode bucket is not needed)
        runner = ModelRunner(tiny, lay, attention_backend=tiny_spec.attention_backend, allocate_cache=False,
                             buckets=StepBuckets(prefill=((2, 32),), decode=(2,)))
        return ProgramMemory.of(runner._step.lower(runner.weights, runner.cache, *runner.padding_step((2, 32))).compile()).temp

    small, large = prefill_scratch(smallest), prefill_scratch(layout)
    sliding_pool = layout.num_sliding_blocks * layout.block_size * layout.head_dim * 4 * len(layout.sliding_layers)
    assert sliding_pool > 40 * PACKING_NOISE  # a copy of it would show
    assert large <= small + PACKING_NOISE, (small, large)


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


def _memory_for(model, spec, activations, layout: PagedCacheLayout) -> int:
    """Device memory whose `UTILIZATION` share holds the weights, the activations and `layout`'s
    pools with half a compressed block to spare: each sequence slot costs its sliding ring and
    compressor state, each compressed block its CSA, indexer and HCA entries (the planner's rule)."""
    pools = plan_capacity(model.config, spec, max_model_len=ARGS["max_model_len"],
                          max_num_seqs=1, block_size=ARGS["block_size"]).pools
    per_slot = sum(p.bytes_per_seq for p in pools if p.name in ("sliding", "csa_state", "hca_state"))
    per_block = sum(p.bytes_per_block for p in pools if p.name in ("csa", "indexer", "hca"))
    assert per_block // 2 > PACKING_NOISE  # the half block to spare absorbs the measurements' packing
    kv = layout.num_seq_slots * per_slot + layout.num_compressed_blocks * per_block
    return math.ceil((_weight_bytes(model) + activations.reserved_bytes + kv + per_block // 2) / UTILIZATION)


@pytest.fixture(scope="module")
def gpu_memory(model, spec, activations, engine_layout) -> int:
    return _memory_for(model, spec, activations, engine_layout)


def _gpu_llm(checkpoint, gpu_memory, reserve=None):
    """tests/test_engine.py's engine, its pools sized from a simulated GPU's memory (no override),
    and the layouts its activations were measured on. `reserve`: what the measurement reports
    instead (bytes), to see the builder find out from the warmed-up programs."""
    args = {k: v for k, v in ARGS.items() if k != "num_gpu_blocks_override"}
    measured_on = []

    def measure(model, layout, **kwargs):
        measured_on.append((layout, kwargs["buckets"]))
        measured = measure_activations(model, layout, **kwargs)
        return measured if reserve is None else dataclasses.replace(measured, step=reserve, step_outputs=0,
                                                                    scores=0, sampler=0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builder, "device_memory", lambda device: gpu_memory)
        patch.setattr(activations_module, "measure_activations", measure)
        return LLM(str(checkpoint), **args, gpu_memory_utilization=UTILIZATION), measured_on


@pytest.fixture(scope="module")
def gpu_llm(checkpoint, gpu_memory):
    return _gpu_llm(checkpoint, gpu_memory)


def test_pools_are_sized_after_the_activations(gpu_llm, gpu_memory, activations, engine_layout, model):
    """On a GPU the pools get what remains of gpu_memory_utilization x memory after the weights and
    the activations, measured once, on the largest prefill and decode buckets compiled for the
    smallest pools (one slot): the engine's layout exactly, for memory sized to hold it, and its
    programs compiled once, for that layout."""
    gpu_llm, measured_on = gpu_llm
    [(layout, buckets)] = measured_on
    assert (layout.num_seq_slots, layout.num_compressed_blocks) == (1, math.ceil(ARGS["max_model_len"] / ARGS["block_size"]) + 1)
    assert buckets.prefill == (max(ARGS["buckets"].prefill, key=lambda b: b[0] * b[1]),)
    assert buckets.decode == (max(ARGS["buckets"].decode),)
    assert gpu_llm.plan.sized_from == "memory"
    # The largest buckets on the smallest pools need what every bucket on the engine's pools needs.
    assert abs(gpu_llm.plan.reserved_bytes - activations.reserved_bytes) <= PACKING_NOISE
    assert engine_activations(gpu_llm.engine).reserved_bytes <= gpu_llm.plan.reserved_bytes
    assert gpu_llm.layout == engine_layout
    reserved = gpu_llm.plan.reserved_bytes
    assert _weight_bytes(gpu_llm.model) + reserved + gpu_llm.cache_bytes <= UTILIZATION * gpu_memory
    out = gpu_llm.generate([{"prompt_token_ids": [0, 5, 6, 7]}],
                           dsv4_jax.SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_programs_that_need_more_than_measured_make_the_pools_planned_again(monkeypatch, caplog):
    """A measurement that came out short (as a step whose scratch grows with the pools would make
    it) is caught by the warmed-up programs' own figures: the builder says so, frees the first
    engine's pools, sizes them again with those figures and serves on the second engine; short a
    second time is an error, never an engine that runs out of memory while serving. (The figures
    themselves are XLA's: `engine_activations` against the plan in the test above.)"""
    sized, engines, needs = [], [], iter([5_000, None])

    class Engine:
        def __init__(self, layout):
            self.layout, self.released = layout, False

        def warmup(self, progress):
            return 0

        def release_cache(self):
            self.released = True

    def size_pools(config, model, channel, reserved):
        sized.append(reserved)
        return config, types.SimpleNamespace(reserved_bytes=reserved or 1_000), f"layout {len(sized)}"

    def engine(config, model, tokenizer, layout, block_manager_factory):
        engines.append(Engine(layout))
        return engines[-1]

    config = types.SimpleNamespace(distributed=types.SimpleNamespace(nnodes=1), tokenizer="tok")
    monkeypatch.setattr(builder, "_load", lambda config: "model")
    monkeypatch.setattr("dsv4_jax.chat.tokenizer.load_tokenizer", lambda path: "tokenizer")
    monkeypatch.setattr(builder, "_size_pools", size_pools)
    monkeypatch.setattr(builder, "_engine", engine)
    monkeypatch.setattr(builder, "_activations_beyond", lambda engine, plan: next(needs))
    with caplog.at_level(logging.WARNING, logger=builder.__name__):
        built = builder.build_engine(config)
    assert sized == [None, 5_000]  # measured first, then the programs' own figure
    assert [e.released for e in engines] == [True, False] and built.engine is engines[1]
    assert built.engine.layout == "layout 2" and "sizing the pools again" in caplog.text
    needs, sized[:] = iter([5_000, 6_000]), []
    with pytest.raises(RuntimeError, match="need 0.0 MiB of activations per device, more than the 0.0 MiB"):
        builder.build_engine(config)


def test_activations_that_leave_no_room_are_refused(model, spec, engine_layout, activations):
    """Memory that holds the weights and one sequence, but not the activations too: a ValueError
    naming the flags (the planner raises it before any pool is allocated)."""
    one_seq = dataclasses.replace(engine_layout, num_seq_slots=1, num_compressed_blocks=2)
    memory = _memory_for(model, spec, activations, one_seq) - math.ceil(activations.reserved_bytes / UTILIZATION)
    plan = functools.partial(plan_capacity, model.config, spec, max_model_len=ARGS["max_model_len"],
                             device_memory_bytes=memory, gpu_memory_utilization=UTILIZATION,
                             weight_bytes=_weight_bytes(model), block_size=ARGS["block_size"], max_num_seqs=1)
    assert plan(reserved_bytes=0).num_seq_slots == 1
    with pytest.raises(ValueError, match=r"reserved for activations.*--max-num-batched-tokens"):
        plan(reserved_bytes=activations.reserved_bytes)
