"""The one way an engine is built, for `LLM` and the server alike: from a resolved `EngineConfig`
(engine/args.py) to a warmed-up `LLMEngine`.

The phases, each logged with its seconds: the step channel of a multi-node run (every node
compares its settings first), the weights (`load_model`), the tokenizer, the pools (on a GPU:
what the device's memory holds once the weights and the activations are counted; across nodes
the leader's pools, max_num_seqs and buckets are every node's), the engine, and the warm-up,
which builds every program once at its final shapes (reading it back from the program cache,
engine/program_cache.py, where an earlier start compiled it) and reports its progress to a
callback (the server's `/health`).

Activations on a GPU are measured from the largest prefill and decode buckets compiled for the
smallest pools (shapes only: a step's scratch does not grow with the pools, since every step
updates them in place; tests/test_activations.py holds that), so the full set of programs is
compiled once, for the pools finally allocated. Those programs' own figures are then checked
against what was reserved: a step whose scratch did grow with the pools makes the builder plan
again with it (logged), never serve on a reservation it exceeds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from dsv4_jax.engine.args import EngineConfig, default_buckets

logger = logging.getLogger(__name__)

# `progress(phase, done, total)`: the phase of the start-up under way ("loading weights", "sizing
# the KV cache", "compiling"), and for compiling the programs done of all.
Progress = Callable[[str, int, int], None]


@dataclasses.dataclass
class BuiltEngine:
    """A warmed-up engine and what it was built from."""

    engine: Any  # dsv4_jax.engine.engine.LLMEngine
    config: EngineConfig  # as resolved; max_num_seqs and buckets as the pools bound them
    plan: Any  # dsv4_jax.kv_cache.planner.CapacityPlan of the pools allocated
    model: Any  # the loaded dsv4_jax.weights.loading.CausalLM the engine steps
    channel: Any = None  # a follower's step channel to the leader (None on the leader and on one node)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per phase

    def follow(self) -> int:
        """On a follower node: run the leader's steps until it shuts down; the device calls made."""
        if self.channel is None:
            raise ValueError("follow() is for the followers of a multi-node run (node_rank >= 1)")
        return self.engine.follow(self.channel)


def build_engine(config: EngineConfig, *, block_manager_factory: Callable[..., Any] | None = None,
                 progress: Progress | None = None) -> BuiltEngine:
    """Load, size, build and warm up the engine `config` describes. `block_manager_factory`
    makes each data-parallel rank's `BlockManager` (the scheduler's default when None).
    A failure on one node of several is told to the others (`StartUp`)."""
    from dsv4_jax.parallel.distributed import StartUp, StepChannel

    progress = progress or (lambda phase, done, total: None)
    timings: dict[str, float] = {}
    with StartUp(config.distributed) as start_up:
        channel = None
        if config.distributed.nnodes > 1:  # before anything runs a collective: every node runs one program
            make = StepChannel.leader if config.distributed.is_leader else StepChannel.follower
            channel = make(config.distributed, config.node_settings())
            start_up.watch(channel)
        with _phase(timings, "load", progress, "loading weights"):
            from dsv4_jax.chat.tokenizer import load_tokenizer, tokenizer_file

            model = _load(config)
            tokenizer = load_tokenizer(config.tokenizer)
        logger.info("tokenizer: %s", tokenizer_file(config.tokenizer))  # what a benchmark client must load
        reserved = None  # activations per device: measured on a GPU, then as the warmed-up programs need
        while True:
            with _phase(timings, "sizing", progress, "sizing the KV cache"):
                config, plan, layout = _size_pools(config, model, channel, reserved)
            engine = _engine(config, model, tokenizer, layout, block_manager_factory)
            start = time.perf_counter()
            with _phase(timings, "warm-up", progress, "compiling"):
                compiled = engine.warmup(progress=lambda what, done, total: progress(f"compiling {what}", done, total))
            logger.info("warm-up: %d compiles in %.1fs", compiled, time.perf_counter() - start)
            needed = _activations_beyond(engine, plan)
            if needed is None:
                break
            if reserved is not None:  # measured at these pools already: cannot happen twice
                raise RuntimeError(f"the engine's programs need {needed / 2**20:.1f} MiB of activations per device, "
                                   f"more than the {plan.reserved_bytes / 2**20:.1f} MiB reserved for them")
            logger.warning("the steps need %.1f MiB of activations per device at these pools, not the %.1f MiB measured "
                           "at the smallest (a step's scratch grows with the pools): sizing the pools again",
                           needed / 2**20, plan.reserved_bytes / 2**20)
            engine.release_cache()
            reserved = needed
        # Every process warmed up the same way; from here the leader's steps are every node's.
        if channel is not None and config.distributed.is_leader:
            engine.lead(channel)
            channel = None
    logger.info("start-up: %s", ", ".join(f"{name} {seconds:.1f}s" for name, seconds in timings.items()))
    return BuiltEngine(engine, config, plan, model, channel, timings)


def _engine(config: EngineConfig, model, tokenizer, layout, block_manager_factory):
    from dsv4_jax.engine.engine import LLMEngine

    engine = LLMEngine(
        model, tokenizer, layout, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
        buckets=config.buckets, attention_backend=config.kv.attention_backend,
        max_num_batched_tokens=config.args.max_num_batched_tokens, seed=config.args.seed,
        async_scheduling=config.args.async_scheduling, block_manager_factory=block_manager_factory,
        structured_outputs_config=config.structured_outputs_config,
        num_prefix_snapshots=config.num_prefix_snapshots, prefix_caching_hash_algo=config.args.prefix_caching_hash_algo,
        speculative_config=config.speculative_config,
    )
    logger.info("KV cache per data-parallel rank (%d): %d sequence slots, %d compressed blocks of %d positions; "
                "%.1f MiB on the mesh", config.parallel.data_parallel_size, layout.num_seq_slots,
                layout.num_compressed_blocks, layout.block_size, engine.cache_bytes / 2**20)
    return engine


class _phase:
    """Adds one phase's seconds to `timings[name]` (a phase may run twice: the pools planned again),
    and tells `progress` it began."""

    def __init__(self, timings: dict[str, float], name: str, progress: Progress, description: str):
        self.timings, self.name = timings, name
        progress(description, 0, 0)

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.timings[self.name] = self.timings.get(self.name, 0.0) + time.perf_counter() - self.start


def _load(config: EngineConfig):
    """The weights, on the mesh where there is one (logged: its shape and what this node holds)."""
    import jax

    from dsv4_jax.parallel.sharding import make_mesh, node_weight_bytes
    from dsv4_jax.weights.loading import load_model

    parallel = config.parallel
    mesh = make_mesh(parallel) if parallel.world_size > 1 else None
    model = load_model(config.model_dir, dtype=config.dtype, mesh=mesh, parallel=parallel if mesh is not None else None,
                       load_format=config.load_format)
    if mesh is not None:
        logger.info("mesh: data %d x tensor %d over devices %s, routed experts %s", parallel.data_parallel_size,
                    parallel.tensor_parallel_size, [d.id for d in mesh.devices.flat],
                    "whole on each device (expert parallel)" if parallel.enable_expert_parallel
                    else "split along their intermediate dimension")
        held = node_weight_bytes(model.state)
        logger.info("weights on this node's %d devices: %.2f MiB of the model's %.2f MiB (routed experts: "
                    "%.2f of %.2f MiB)", jax.local_device_count(), held.local / 2**20, held.total / 2**20,
                    held.local_experts / 2**20, held.total_experts / 2**20)
    return model


# ---- the pools ----------------------------------------------------------------------------------
def device_memory(device) -> int | None:
    """The memory the pools are sized from: JAX's usable memory of a GPU (`bytes_limit`); None on
    CPU, where the pools are sized from max_num_seqs x max_model_len instead."""
    from dsv4_jax.kv_cache.planner import live_device_memory

    return live_device_memory(device) if device.platform == "gpu" else None


def _size_pools(config: EngineConfig, model, channel, reserved: int | None) -> tuple[EngineConfig, Any, Any]:
    """(config with max_num_seqs as the pools bound it, the plan, the layout). On CPU the pools
    hold max_num_seqs x max_model_len positions; on a GPU what the memory holds beside the weights
    and `reserved` bytes of activations (None: measured here). Across nodes the leader's pools are
    every node's (device memory may differ): every node measures (a collective every process
    joins), then takes the leader's."""
    import jax

    device = jax.local_devices()[0]
    memory = device_memory(device)
    # What the first device holds (every device holds the same share).
    weight_bytes = sum(s.data.nbytes for x in jax.tree.leaves(model.state)
                       for s in x.addressable_shards if s.device == device)
    if memory is not None and reserved is None:
        reserved = _measure_activations(config, model, memory, weight_bytes)
    config = _with_snapshots(config, memory, weight_bytes, reserved or 0)
    config, plan = _plan(config, memory, weight_bytes, reserved or 0)
    layout = _layout(config, plan)
    if channel is not None:  # what every node's programs are built for: the leader's
        if config.distributed.is_leader:
            channel.send((config.max_num_seqs, config.buckets, layout, config.num_prefix_snapshots))
        else:
            max_num_seqs, buckets, layout, num_snapshots = channel.receive()
            config = dataclasses.replace(config, max_num_seqs=max_num_seqs, buckets=buckets,
                                         num_prefix_snapshots=num_snapshots)
    return config, plan, layout


# Prefix-cache snapshots per sequence slot when --num-prefix-snapshots is not given, and the most
# of the KV memory they may take then (a V4-Flash fp8 snapshot is ~4 MiB, four compressed blocks).
PREFIX_SNAPSHOTS_PER_SEQ = 4
PREFIX_SNAPSHOT_MEMORY_FRACTION = 0.1


def _with_snapshots(config: EngineConfig, memory: int | None, weight_bytes: int, reserved: int) -> EngineConfig:
    """`config` with its prefix-cache snapshots counted (per data-parallel rank; 0 with caching
    off) and their size: --num-prefix-snapshots, else PREFIX_SNAPSHOTS_PER_SEQ per sequence, on a
    GPU at most PREFIX_SNAPSHOT_MEMORY_FRACTION of what the KV cache gets."""
    from dsv4_jax.kv_cache.paged import PagedCacheLayout
    from dsv4_jax.kv_cache.snapshots import snapshot_bytes

    if not config.prefix_caching:
        return dataclasses.replace(config, num_prefix_snapshots=0, snapshot_bytes=0)
    spec = min(1, config.num_speculative_tokens)  # the MTP layer's window and the spare compressor window
    one = snapshot_bytes(PagedCacheLayout.build(config.model_config, config.kv, max_model_len=config.args.block_size,
                                                num_seq_slots=1, block_size=config.args.block_size,
                                                num_mtp_layers=spec, spare_compressor_windows=spec))
    count = config.args.num_prefix_snapshots
    if count is None:
        count = PREFIX_SNAPSHOTS_PER_SEQ * config.max_num_seqs
        if memory is not None:
            kv_budget = int(memory * config.args.gpu_memory_utilization) - weight_bytes - reserved
            count = max(1, min(count, int(kv_budget * PREFIX_SNAPSHOT_MEMORY_FRACTION) // one))
    logger.info("prefix caching: %d snapshots per data-parallel rank of %.2f MiB each (%.1f MiB; "
                "--num-prefix-snapshots)", count, one / 2**20, count * one / 2**20)
    return dataclasses.replace(config, num_prefix_snapshots=count, snapshot_bytes=one)


def _plan(config: EngineConfig, memory: int | None, weight_bytes: int, reserved: int):
    """(config, plan): the pools for config.max_num_seqs; a max_num_seqs chosen by device (not
    given) that the memory cannot hold becomes the number of full-length sequences it can."""
    from dsv4_jax.kv_cache.planner import MeshShape, plan_capacity

    p = config.parallel

    def plan(max_num_seqs: int | None):
        return plan_capacity(
            config.model_config, config.kv, max_model_len=config.max_model_len, device_memory_bytes=memory,
            gpu_memory_utilization=config.args.gpu_memory_utilization, weight_bytes=weight_bytes,
            block_size=config.args.block_size, max_num_seqs=max_num_seqs, reserved_bytes=reserved,
            snapshot_bytes=config.num_prefix_snapshots * config.snapshot_bytes, mesh=MeshShape(p.tensor_parallel_size, p.data_parallel_size, p.expert_parallel_size),
            # Speculative decoding: the MTP layer's window pool and a spare compressor window a slot.
            num_mtp_layers=min(1, config.num_speculative_tokens),
            spare_compressor_windows=min(1, config.num_speculative_tokens),
        )

    try:
        return config, plan(config.max_num_seqs)
    except ValueError:
        if memory is None or not config.max_num_seqs_is_default:
            raise
    fits = plan(None).num_seq_slots  # raises, naming the numbers, when not even one sequence fits
    logger.info("max_num_seqs %d (the default for this GPU) -> %d: the KV pools of --gpu-memory-utilization %s hold "
                "%d full-length (%d-token) sequences beside the weights and activations; pass --max-num-seqs to choose",
                config.max_num_seqs, fits, config.args.gpu_memory_utilization, fits, config.max_model_len)
    args = config.args
    buckets = args.buckets or default_buckets(fits, config.max_model_len, args.max_num_batched_tokens)
    config = dataclasses.replace(config, max_num_seqs=fits, buckets=buckets)
    return config, plan(fits)


def _layout(config: EngineConfig, plan):
    from dsv4_jax.kv_cache.paged import PagedCacheLayout

    layout = PagedCacheLayout.from_plan(config.model_config, plan)
    override = config.args.num_gpu_blocks_override
    if override is not None:
        need = -(-config.max_model_len // config.args.block_size)
        if override < need:
            raise ValueError(f"num_gpu_blocks_override ({override}) holds less than one sequence of max_model_len "
                             f"{config.max_model_len} ({need} blocks of {config.args.block_size})")
        layout = dataclasses.replace(layout, num_compressed_blocks=override)
    return layout


def _measure_activations(config: EngineConfig, model, memory: int, weight_bytes: int) -> int:
    """Bytes per device the pools leave for activations: the largest prefill and decode buckets'
    programs compiled for the smallest pools (one slot, one sequence's blocks; shapes only)."""
    from dsv4_jax.engine.activations import measure_activations

    start = time.perf_counter()
    _, smallest = _plan(dataclasses.replace(config, max_num_seqs=1, max_num_seqs_is_default=False), None, 0, 0)
    layout = _layout(dataclasses.replace(config, args=dataclasses.replace(config.args, num_gpu_blocks_override=None)),
                     smallest)
    activations = measure_activations(model, layout, buckets=largest_buckets(config.buckets),
                                      attention_backend=config.kv.attention_backend, max_model_len=config.max_model_len,
                                      num_speculative_tokens=config.num_speculative_tokens)
    logger.info("activations: %s, measured in %.1fs; the KV cache gets what remains of --gpu-memory-utilization %s "
                "of %.2f GiB after them and %.2f GiB of weights", activations.describe(), time.perf_counter() - start,
                config.args.gpu_memory_utilization, memory / 2**30, weight_bytes / 2**30)
    return activations.reserved_bytes


def largest_buckets(buckets):
    """The prefill bucket of the most tokens (then rows) and the widest decode bucket: what the
    activations are measured on (a step's scratch grows with its tokens)."""
    from dsv4_jax.engine.runner import StepBuckets

    return StepBuckets(prefill=(max(buckets.prefill, key=lambda b: (b[0] * b[1], b[0])),), decode=(max(buckets.decode),))


def _activations_beyond(engine, plan) -> int | None:
    """The warmed-up programs' activations (their executables' buffer assignment: nothing is
    compiled) where they exceed what the plan reserved, else None (and on CPU, where nothing is
    reserved; and where the backend reports no figures for executables read back from the program
    cache: they passed this check when they were built)."""
    if plan.device_memory_bytes is None:
        return None
    from dsv4_jax.engine.activations import engine_activations

    try:
        needed = engine_activations(engine).reserved_bytes
    except RuntimeError as error:  # ProgramMemory.of: no memory analysis
        logger.info("the warmed-up programs' memory was not checked against the reservation: %s", error)
        return None
    return needed if needed > plan.reserved_bytes else None
