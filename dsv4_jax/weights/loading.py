"""`load_model`: a DeepSeek checkpoint directory -> a callable model.

Tensors keep the checkpoint's representation on the device (FP8 + block scales, MXFP4,
bf16/f32); the forward dequantises per use inside one jitted pure function (the module is
split once; no `nnx.jit` per call).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from dsv4_jax.parallel import sharding as sh
from dsv4_jax.weights import converted_cache
from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.model.layers import TRANSPOSED
from dsv4_jax.model.options import ForwardOptions
from dsv4_jax.model.transformer import DeepseekV4, Segment, check_token_ids

Path_ = tuple[Any, ...]
logger = logging.getLogger(__name__)


def parameter_names(path: Path_, plan: list[Segment], n_experts: int) -> Iterator[tuple[tuple[int, ...], str]]:
    """Checkpoint names stored in the state leaf at `path`, with each one's index in the leaf.

    Stacked layers add a leading repetition axis and routed experts an expert axis, so one leaf
    can hold many checkpoint tensors: `segments.2.units.1.ffn.experts.w1.weight[k, e]` is
    `layers.{first + 2k + 1}.ffn.experts.{e}.w1.weight`.
    """
    if path[0] == "segments":
        segment = plan[path[1]]
        if segment.count > 1:
            position, rest = path[3], path[4:]
            prefixes = [((k,), f"layers.{segment.layer(k, position)}") for k in range(segment.count)]
        else:
            rest, prefixes = path[2:], [((), f"layers.{segment.first}")]
    elif path[0] == "mtp":
        rest, prefixes = path[2:], [((), f"mtp.{path[1]}")]
    else:
        rest, prefixes = path, [((), "")]
    parts = [str(p) for p in rest]
    if "experts" in parts and parts[parts.index("experts") + 1] in ("w1", "w2", "w3"):
        at = parts.index("experts") + 1
        expanded = [((e,), ".".join(parts[:at] + [str(e)] + parts[at:])) for e in range(n_experts)]
    else:
        expanded = [((), ".".join(parts))]
    for index, prefix in prefixes:
        for sub_index, name in expanded:
            yield index + sub_index, f"{prefix}.{name}" if prefix else name


class CausalLM:
    """A loaded DeepSeek-V4: `model(input_ids)` -> float32 logits [batch, seq, vocab].

    Calling it runs the whole-sequence forward (`DeepseekV4.__call__`: no KV cache, the dense
    reference attention), the model's own reference. Serving runs the same weights through
    `DeepseekV4.step` over a paged KV cache: `dsv4_jax.engine.runner.ModelRunner(model, layout,
    attention_backend=...)`, as `LLM` does."""

    def __init__(self, module: DeepseekV4, options: ForwardOptions, mtp_enabled: bool):
        self.config: DeepseekV4Config = module.config
        self.options = options
        self.mtp_enabled = mtp_enabled
        self.graphdef, self.state = nnx.split(module)

    @functools.cached_property
    def _jitted(self) -> dict[str, Callable]:
        graphdef = self.graphdef

        def streams(state, ids, options):
            return nnx.merge(graphdef, state).hidden_streams(ids, options)

        def logits(state, ids, options):
            return nnx.merge(graphdef, state)(ids, options)

        def mtp(state, streams, next_ids, options):
            return nnx.merge(graphdef, state).mtp_logits(streams, next_ids, options)

        return {
            "logits": jax.jit(logits, static_argnums=2),
            "streams": jax.jit(streams, static_argnums=2),
            "mtp": jax.jit(mtp, static_argnums=3),
        }

    def _ids(self, input_ids: Any) -> jax.Array:
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or 0 in ids.shape:
            raise ValueError(f"input_ids must be a non-empty integer array [batch, seq], got {ids.dtype} {ids.shape}")
        check_token_ids(ids, self.config.vocab_size)
        return jnp.asarray(ids.astype(np.int32))

    def __call__(self, input_ids: Any) -> jax.Array:
        return self._jitted["logits"](self.state, self._ids(input_ids), self.options)

    def hidden_streams(self, input_ids: Any) -> jax.Array:
        """The main model's streams before hc_head, [batch, seq, hc_mult, hidden] (MTP input)."""
        return self._jitted["streams"](self.state, self._ids(input_ids), self.options)

    def mtp_logits(self, streams: jax.Array, next_ids: Any) -> jax.Array:
        if not self.mtp_enabled:
            raise ValueError("this checkpoint has no usable DeepSeek-V4 MTP block (it loaded with MTP disabled)")
        return self._jitted["mtp"](self.state, streams, self._ids(next_ids), self.options)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _device_zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    return jnp.zeros(shape, dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _write_slice(buffer: jax.Array, index: jax.Array, value: jax.Array) -> jax.Array:
    """buffer[index] = value, in place (the buffer is donated)."""
    return jax.lax.dynamic_update_index_in_dim(buffer, value, index, 0)


@functools.cache
def _sharded_zeros_fn(shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding) -> Callable[[], jax.Array]:
    """A jitted `() -> zeros(shape)` that creates them in their shards (no device holds them all)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _sharded_write_slice(sharding: NamedSharding) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """`_write_slice` for a buffer sharded as `sharding`, which its result keeps."""
    return jax.jit(_write_slice.__wrapped__, donate_argnums=0, out_shardings=sharding)


def _slice_sharding(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer of a stacked leaf (its leading `layers` axis is never split)."""
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))


def _leaf_shardings(state: nnx.State, mesh: Mesh | None, parallel: sh.ParallelConfig | None) -> dict[Path_, Any]:
    """Leaf path -> where that leaf lives: its `param_shardings` shard(s), or the default device."""
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        return {leaf_path: device for leaf_path, _ in nnx.to_flat_state(state)}
    return dict(nnx.to_flat_state(sh.param_shardings(state, mesh, parallel)))


class _Placer:
    """`put(name, array)` for `load_checkpoint`: each checkpoint tensor to its leaf of the NNX state.

    A tensor of a stacked leaf goes to its slice of a device buffer as soon as that slice (one
    layer: all of its experts) is complete, so the host holds at most one layer's experts of one
    leaf; other tensors go to the device as they arrive. Every tensor of one leaf must have one
    dtype (no silent numeric casts). With a mesh every array goes straight to its shards
    (`param_shardings`): a stacked leaf starts as sharded zeros and each layer is written into
    its shards in place."""

    def __init__(
        self, config: DeepseekV4Config, stack_layers: bool, mesh: Mesh | None = None,
        parallel: sh.ParallelConfig | None = None,
    ):
        full = nnx.eval_shape(lambda: DeepseekV4(config, mtp=True, stack_layers=stack_layers))
        segments = full.segments_plan
        state = nnx.split(full)[1]
        self.shardings = None if mesh is None else _leaf_shardings(state, mesh, parallel)
        # name -> (leaf path, index in leaf, stacked?)
        self.targets: dict[str, tuple[Path_, tuple[int, ...], bool]] = {}
        self.shapes: dict[Path_, tuple[int, ...]] = {}
        self.transposed: set[Path_] = set()  # leaves the model keeps as their checkpoint tensor's transpose
        for leaf_path, variable in nnx.to_flat_state(state):
            stacked = leaf_path[0] == "segments" and segments[leaf_path[1]].count > 1
            for index, name in parameter_names(leaf_path, segments, config.n_routed_experts):
                self.targets[name] = (leaf_path, index, stacked)
            self.shapes[leaf_path] = variable.get_value().shape
            if variable.get_metadata().get(TRANSPOSED):
                self.transposed.add(leaf_path)
        self.placed: dict[Path_, jax.Array] = {}
        self._pending: dict[tuple[Path_, tuple[int, ...]], np.ndarray] = {}
        self._filled: dict[tuple[Path_, tuple[int, ...]], int] = {}
        self._leaf_dtype: dict[Path_, tuple[np.dtype, str]] = {}

    def __call__(self, name: str, array: np.ndarray) -> None:
        leaf_path, index, stacked = self.targets[name]
        if leaf_path in self.transposed:
            array = np.ascontiguousarray(np.swapaxes(array, -1, -2))
        first = self._leaf_dtype.setdefault(leaf_path, (array.dtype, name))
        if first[0] != array.dtype:
            raise ValueError(
                f"checkpoint tensors that the model stacks must share one dtype: {name} is "
                f"{array.dtype} but {first[1]} is {first[0]}"
            )
        if not index:
            self._put(leaf_path, array)
            return
        shape = self.shapes[leaf_path]
        group = (leaf_path, index[:1] if stacked else ())  # one layer's slice, or the whole leaf
        group_shape = shape[len(group[1]) :]
        buffer = self._pending.get(group)
        if buffer is None:
            buffer = self._pending[group] = np.empty(group_shape, array.dtype)
        buffer[index[len(group[1]) :]] = array
        self._filled[group] = self._filled.get(group, 0) + 1
        if self._filled[group] < int(np.prod(group_shape[: len(index) - len(group[1])])):
            return
        value = self._pending.pop(group)
        if not stacked:
            self._put(leaf_path, value)
            return
        layer = np.int32(group[1][0])
        if self.shardings is None:
            if leaf_path not in self.placed:
                self.placed[leaf_path] = _device_zeros(shape, value.dtype)
            self.placed[leaf_path] = _write_slice(self.placed[leaf_path], layer, value)
            return
        sharding = self.shardings[leaf_path]
        if leaf_path not in self.placed:
            self.placed[leaf_path] = _sharded_zeros_fn(shape, value.dtype, sharding)()
        value = jax.device_put(value, _slice_sharding(sharding))  # each device gets only its part
        self.placed[leaf_path] = _sharded_write_slice(sharding)(self.placed[leaf_path], layer, value)

    def _put(self, leaf_path: Path_, array: np.ndarray) -> None:
        """A whole leaf to the default device, or to its shards."""
        if self.shardings is None:
            self.placed[leaf_path] = jax.device_put(array)
        else:
            self.placed[leaf_path] = jax.device_put(array, self.shardings[leaf_path])


def _model_directory(path: str | Path) -> Path:
    """`path` as a model directory, or an error saying what was found there instead."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ValueError(
            f"model path {path} is a file; pass the directory that holds config.json and the *.safetensors files"
        )
    return path


def _abstract_model(config: DeepseekV4Config, mtp: bool, stack_layers: bool) -> tuple[nnx.GraphDef, nnx.State]:
    """The module's graph and its state of shapes (no arrays), as `nnx.split` gives them."""
    return nnx.split(nnx.eval_shape(lambda: DeepseekV4(config, mtp=mtp, stack_layers=stack_layers)))


def _assemble(graphdef: nnx.GraphDef, state: nnx.State, placed: dict[Path_, jax.Array]) -> DeepseekV4:
    """The module with every leaf of the abstract `state` set to its loaded device array."""
    flat = nnx.to_flat_state(state)
    missing = [leaf_path for leaf_path, _ in flat if leaf_path not in placed]
    if missing:  # load_checkpoint validated names, so this is a bug in the mapping
        raise RuntimeError(f"parameters left unfilled after loading: {missing[:5]}")
    for leaf_path, variable in flat:
        variable.set_value(placed[leaf_path])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _resolve_mesh(
    mesh: Mesh | None, parallel: sh.ParallelConfig | None
) -> tuple[Mesh | None, sh.ParallelConfig | None]:
    """(mesh, parallel) with the missing one derived from the other (both None: one device)."""
    if mesh is None:
        return (None, None) if parallel is None else (sh.make_mesh(parallel), parallel)
    if tuple(mesh.axis_names) != sh.MESH_AXES:
        raise ValueError(f"mesh axes must be {sh.MESH_AXES} (dsv4_jax.parallel.sharding.make_mesh), got {mesh.axis_names}")
    if parallel is None:
        return mesh, sh.ParallelConfig(tensor_parallel_size=mesh.shape[sh.TENSOR], data_parallel_size=mesh.shape[sh.DATA])
    if (parallel.data_parallel_size, parallel.tensor_parallel_size) != (mesh.shape[sh.DATA], mesh.shape[sh.TENSOR]):
        raise ValueError(
            f"parallel (--data-parallel-size {parallel.data_parallel_size} x --tensor-parallel-size "
            f"{parallel.tensor_parallel_size}) does not match the mesh {dict(mesh.shape)}"
        )
    return mesh, parallel


def _read_safetensors(
    path: Path, config: DeepseekV4Config, stack_layers: bool, mesh: Mesh | None, parallel: sh.ParallelConfig | None
) -> tuple[DeepseekV4, list[str], bool]:
    """(module, the checkpoint's load warnings, MTP enabled?) read from the safetensors files."""
    from dsv4_jax.weights.checkpoint import load_checkpoint

    placer = _Placer(config, stack_layers, mesh, parallel)
    report = load_checkpoint(path, config, placer)
    module = _assemble(*_abstract_model(config, report.mtp_enabled, stack_layers), placer.placed)
    return module, report.warnings, report.mtp_enabled


def _restore_cached(
    entry: converted_cache.CacheEntry, config: DeepseekV4Config, stack_layers: bool, mesh: Mesh | None,
    parallel: sh.ParallelConfig | None,
) -> DeepseekV4:
    """The module of a converted-weights cache entry, every leaf restored into its shards."""
    graphdef, state = _abstract_model(config, entry.mtp_enabled, stack_layers)
    shardings = _leaf_shardings(state, mesh, parallel)
    by_name = {".".join(map(str, leaf_path)): leaf_path for leaf_path in shardings}
    arrays = converted_cache.restore(entry, {name: shardings[leaf_path] for name, leaf_path in by_name.items()})
    if mesh is None:
        # orbax places arrays committed to their device; `jax.device_put(numpy)` (the safetensors
        # path) leaves them uncommitted, which jit lowers without sharding annotations. Re-placed
        # one leaf at a time (the old buffer goes as the next is made), so a restored model
        # compiles to the very HLO of a loaded one and hits the same persistent-cache entries.
        arrays = {name: jax.device_put(np.asarray(arrays.pop(name))) for name in list(arrays)}
    for warning in entry.warnings:  # as the safetensors load said them
        logger.warning(warning)
    return _assemble(graphdef, state, {by_name[n]: a for n, a in arrays.items()})


def _load_weights(
    path: Path, config: DeepseekV4Config, dtype: str, stack_layers: bool, mesh: Mesh | None,
    parallel: sh.ParallelConfig | None, load_format: str, weights_cache_dir: str | Path | None,
) -> tuple[DeepseekV4, bool]:
    """(module, MTP enabled?) from the converted-weights cache or the safetensors files, as
    `load_format` says (`converted_cache.LOAD_FORMATS`); logs which path it took and its seconds."""
    start = time.perf_counter()
    if load_format == "safetensors":
        module, _, mtp_enabled = _read_safetensors(path, config, stack_layers, mesh, parallel)
        logger.info("weights: read %s (--load-format safetensors) in %.2f s", path, time.perf_counter() - start)
        return module, mtp_enabled
    fields = converted_cache.key_fields(path, dtype, stack_layers, mesh, parallel)
    directory = converted_cache.entry_directory(fields, weights_cache_dir)
    entry = converted_cache.find(directory)
    if entry is not None:
        module = _restore_cached(entry, config, stack_layers, mesh, parallel)
        logger.info("weights: restored from the converted-weights cache %s in %.2f s", directory,
                    time.perf_counter() - start)
        return module, entry.mtp_enabled
    if load_format == "orbax":
        raise ValueError(
            f"--load-format orbax: there is no converted-weights cache for {path} (with this dtype, mesh and "
            f"settings) at {directory}; run once with --load-format auto to write it"
        )
    module, warnings, mtp_enabled = _read_safetensors(path, config, stack_layers, mesh, parallel)
    read = time.perf_counter()
    arrays = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module))}
    written = converted_cache.save(directory, arrays, fields=fields, mtp_enabled=mtp_enabled, warnings=warnings)
    logger.info(
        "weights: read %s in %.2f s; %s the converted-weights cache %s in %.2f s", path, read - start,
        "wrote" if written else "did not write", directory, time.perf_counter() - read,
    )
    return module, mtp_enabled


# Decoder-layer weights (as stored) from which CPUs unroll the layers (`default_stack_layers`).
CPU_UNROLL_LAYER_BYTES = 64 << 20


def default_stack_layers(config: DeepseekV4Config) -> bool:
    """Stacked layers (one scan: compile time independent of depth) unless on a CPU with more
    than `CPU_UNROLL_LAYER_BYTES` of layer weights. XLA:CPU copies each layer's weights out of
    the stack on every step wherever a loop or a library matmul reads them: on the mid-size
    benchmark model (about 0.6 GB of layers) that is about a third of a 32-row decode step (490
    ms stacked, 335 ms unrolled). Small models (the built-in, the tests' models)
    copy little and compile faster stacked."""
    from dsv4_jax.weights.checkpoint import checkpoint_layout

    if jax.default_backend() != "cpu":
        return True
    itemsize = {"F32": 4, "BF16": 2, "I64": 8}  # the rest (fp8, packed fp4, scales) one byte
    layer_bytes = sum(
        math.prod(spec.shape) * itemsize.get(spec.dtype, 1)
        for name, spec in checkpoint_layout(config, include_mtp=False).items() if name.startswith("layers.")
    )
    return layer_bytes <= CPU_UNROLL_LAYER_BYTES


def load_model(
    path: str | Path,
    dtype: str = "float32",
    *,
    kv_cache_rounding: bool = False,
    stack_layers: bool | None = None,
    mesh: Mesh | None = None,
    parallel: sh.ParallelConfig | None = None,
    load_format: str = "safetensors",
    weights_cache_dir: str | Path | None = None,
) -> CausalLM:
    """Load a DeepSeek-V4 checkpoint directory (DeepSeek's names, or transformers' saved ones).

    `dtype` is the compute dtype of activations and dequantised weights; `stack_layers` runs
    repeated layers under one scan over stacked weights (True) or every layer unrolled (False);
    None: `default_stack_layers()`.

    The model's call is the whole-sequence reference forward (dense attention, no cache); the KV
    cache's dtype and attention backend belong to the serving path, which the engine resolves
    itself (`dsv4_jax.kv_cache.resolve_for_device`) and hands to its `ModelRunner`.
    `kv_cache_rounding` only changes the reference: it rounds the window and compressed KV to the
    fp8_ds_mla grid and the indexer keys to the fp8 indexer format, as the official model's QAT
    forward does (spec 3.8), so that an fp8_ds_mla cache can be checked against the dense forward
    it is meant to reproduce (tests/test_runner.py); it needs a NoPE width that is a multiple of 64.

    `mesh` / `parallel` (`dsv4_jax.parallel.sharding`; either one implies the other) load every tensor
    straight into its shards as it is read, and the model runs on that mesh
    (`model.options = mesh_options(...)`). `load_format` ("auto", "safetensors", "orbax", as
    `--load-format`) and `weights_cache_dir` (default `converted_cache.default_root()`) choose between
    the safetensors files and the converted-weights cache (`dsv4_jax.weights.converted_cache`): "safetensors"
    (this function's default) never touches the cache; "auto" (`LLM`'s and the server's default)
    restores a valid cache entry, else reads the files and writes one; "orbax" only restores, and a
    missing entry is a ValueError.

    A bad directory (missing, no or invalid config.json, missing or truncated shards, tensors
    that do not fit the config) raises a ValueError or FileNotFoundError naming the file."""
    converted_cache.check_load_format(load_format)
    mesh, parallel = _resolve_mesh(mesh, parallel)
    path = _model_directory(path)
    config = DeepseekV4Config.from_json(path)
    if stack_layers is None:
        stack_layers = default_stack_layers(config)
    if kv_cache_rounding and config.nope_head_dim % 64:
        raise ValueError(
            f"kv_cache_rounding rounds KV as the fp8_ds_mla format stores it, NoPE dims in blocks of 64, but this "
            f"model has {config.nope_head_dim} (head_dim {config.head_dim} - qk_rope_head_dim "
            f"{config.qk_rope_head_dim})"
        )
    options = ForwardOptions(dtype=dtype, kv_cache_rounding=kv_cache_rounding)
    if mesh is not None:
        options = sh.mesh_options(options, mesh, parallel)
    module, mtp_enabled = _load_weights(
        path, config, dtype, stack_layers, mesh, parallel, load_format, weights_cache_dir
    )
    return CausalLM(module, options, mtp_enabled)


def shard_model(model: CausalLM, mesh: Mesh, parallel: sh.ParallelConfig) -> CausalLM:
    """Place a loaded model's weights in their shards (in place; returns the model)."""
    model.state = jax.device_put(model.state, sh.param_shardings(model.state, mesh, parallel))
    model.options = sh.mesh_options(model.options, mesh, parallel)
    return model
