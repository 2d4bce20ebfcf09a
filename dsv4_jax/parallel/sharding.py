"""Sharding the model over a device mesh: the mesh, and the one table from the model's logical axis
names (`dsv4_jax.model.axes`) to mesh axes.

Every parameter declares, where it is defined, one logical axis name per dimension (the
`axes` metadata of its `nnx.Param`; block scales carry the axes of the weight they scale, so a
scale always splits along the same mesh axis as its weight). `mesh_axis_rules` translates logical
names to mesh axes in one place; `param_shardings` applies it to a model state and refuses a
dimension that does not divide by its mesh axes (never a silent replicate) and two logical axes
of one tensor claiming the same mesh axis.

The mesh has two named axes, `data` x `tensor`. Query heads, the grouped output projection,
the shared expert's intermediate dimension and the vocabulary go over `tensor`. Routed experts
go over the expert axis (`data` x `tensor`) with expert parallelism, else along their
intermediate dimension over `tensor` (replicating every expert on every device cannot fit
DeepSeek-V4-Flash on two GPUs). Everything else (norms, mHC, router, compressors, the lightning
indexer, the shared K=V projection) is small and replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv4_jax.model.axes import (
    COMPRESS, DATA, EMBED, EXPERTS, GROUP_HEAD_DIMS, HASH_VOCAB, HC, HEAD_DIMS, HEADS, INDEXER, KV_DIM, LAYERS,
    MESH_AXES, MOE_FFN, NORM, O_GROUP_RANKS, Q_LORA, ROUTER, SHARED_FFN, TENSOR, VOCAB,
)

if TYPE_CHECKING:
    from dsv4_jax.config import DeepseekV4Config
    from dsv4_jax.model.options import ForwardOptions

_REPLICATED = (LAYERS, EMBED, NORM, Q_LORA, KV_DIM, GROUP_HEAD_DIMS, COMPRESS, INDEXER, ROUTER, HASH_VOCAB, HC)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """vLLM's `--tensor-parallel-size`, `--data-parallel-size`, `--enable-expert-parallel`."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        return self.world_size if self.enable_expert_parallel else 1


def mesh_axis_rules(parallel: ParallelConfig) -> dict[str, tuple[str, ...]]:
    """THE table: logical axis -> the mesh axes it splits over (empty: replicated)."""
    experts_split = (DATA, TENSOR) if parallel.enable_expert_parallel else ()
    rules = {name: () for name in _REPLICATED}
    rules |= {
        VOCAB: (TENSOR,),
        HEADS: (TENSOR,),
        HEAD_DIMS: (TENSOR,),
        O_GROUP_RANKS: (TENSOR,),
        SHARED_FFN: (TENSOR,),
        EXPERTS: experts_split,
        MOE_FFN: () if parallel.enable_expert_parallel else (TENSOR,),
    }
    return rules


def make_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, tensor) mesh over the first data x tensor devices (as vLLM, extra ones stay idle)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < parallel.world_size:
        raise ValueError(
            f"--tensor-parallel-size {parallel.tensor_parallel_size} x --data-parallel-size "
            f"{parallel.data_parallel_size} needs {parallel.world_size} devices, but {len(devices)} are visible"
        )
    grid = np.array(devices[: parallel.world_size], dtype=object)
    return Mesh(grid.reshape(parallel.data_parallel_size, parallel.tensor_parallel_size), MESH_AXES)


def partition_spec(
    name: str,
    shape: tuple[int, ...],
    axes: tuple[str, ...] | None,
    rules: dict[str, tuple[str, ...]],
    mesh_shape: Mapping[str, int],
) -> PartitionSpec:
    """The PartitionSpec of parameter `name` (shape, logical axes) under `rules` on a mesh of
    `mesh_shape` ({axis name: size}, e.g. `Mesh.shape`)."""
    if axes is None:
        raise ValueError(f"parameter {name} {shape} declares no logical axes (nnx.Param(..., axes=...))")
    if len(axes) != len(shape):
        raise ValueError(f"parameter {name} has shape {shape} but declares {len(axes)} logical axes {axes}")
    unknown = [a for a in axes if a not in rules]
    if unknown:
        raise ValueError(f"parameter {name} declares logical axes {unknown} that the sharding rules do not know")
    claimed: dict[str, str] = {}
    spec = []
    for size, logical in zip(shape, axes):
        mesh_axes = rules[logical]
        for axis in mesh_axes:
            if axis in claimed:
                raise ValueError(
                    f"parameter {name} {shape}: logical axes {claimed[axis]!r} and {logical!r} both claim "
                    f"mesh axis {axis!r}"
                )
            claimed[axis] = logical
        parts = math.prod(mesh_shape[a] for a in mesh_axes)
        if size % parts:
            raise ValueError(
                f"parameter {name} {shape}: dimension {logical!r} of size {size} does not divide by mesh axes "
                f"{mesh_axes} of size {parts}"
            )
        spec.append(None if not mesh_axes or parts == 1 else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def partition_specs(model_state: nnx.State, mesh_shape: Mapping[str, int], parallel: ParallelConfig) -> nnx.State:
    """The PartitionSpec of every leaf of an NNX state (same tree), from its declared axes.
    Needs only the mesh's shape, so abstract states (`nnx.eval_shape`) of any size can be checked."""
    rules = mesh_axis_rules(parallel)

    def spec(path: tuple[Any, ...], variable: nnx.Variable) -> PartitionSpec:
        name = ".".join(str(p) for p in path)
        shape = tuple(variable.get_value().shape)
        return partition_spec(name, shape, variable.get_metadata().get("axes"), rules, mesh_shape)

    return nnx.map_state(spec, model_state)


def param_shardings(model_state: nnx.State, mesh: Mesh, parallel: ParallelConfig) -> nnx.State:
    """The NamedSharding of every leaf of an NNX state (same tree), from its declared axes."""
    specs = partition_specs(model_state, mesh.shape, parallel)
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def check_model_splits(config: DeepseekV4Config, parallel: ParallelConfig) -> None:
    """ValueError naming the flags when `parallel` cannot split this model (checked on the
    abstract model: no weights are read)."""
    if parallel.world_size == 1:
        return
    from dsv4_jax.model.transformer import DeepseekV4

    abstract = nnx.state(nnx.eval_shape(lambda: DeepseekV4(config, mtp=True, stack_layers=True)))
    mesh_shape = {DATA: parallel.data_parallel_size, TENSOR: parallel.tensor_parallel_size}
    flags = (f"--tensor-parallel-size {parallel.tensor_parallel_size} --data-parallel-size "
             f"{parallel.data_parallel_size}{' --enable-expert-parallel' if parallel.enable_expert_parallel else ''}")
    try:
        specs = partition_specs(abstract, mesh_shape, parallel)
    except ValueError as error:
        raise ValueError(f"{flags} cannot split this model: {error}") from None
    # A block-scaled weight dequantises on its own shard: each shard must hold whole scale blocks
    # (fp8: the checkpoint's weight_block_size over the last two dims; fp4: 32 values = 16 bytes).
    leaves = dict(nnx.to_flat_state(abstract))
    spec_of = dict(nnx.to_flat_state(specs))
    for path, scale in leaves.items():
        weight = leaves.get((*path[:-1], "weight"))
        if path[-1] != "scale" or weight is None:
            continue
        shape = weight.get_value().shape
        fp8 = weight.get_value().dtype == jnp.float8_e4m3fn
        last = tuple(config.quantization.weight_block_size) if fp8 else (1, shape[-1] // scale.get_value().shape[-1])
        blocks = (1,) * (len(shape) - 2) + last
        for dim, (size, block, axes) in enumerate(zip(shape, blocks, spec_of[path])):
            parts = math.prod(mesh_shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
            if parts > 1 and (size // parts) % block:
                raise ValueError(
                    f"{flags} cannot split this model: {'.'.join(map(str, path[:-1]))} dimension {dim} ({size}) "
                    f"in {parts} shards of {size // parts} cuts its scale blocks of {block}"
                )


def mesh_options(options: ForwardOptions, mesh: Mesh, parallel: ParallelConfig) -> ForwardOptions:
    """The forward options of a model whose weights are sharded over `mesh` as `parallel` says."""
    return dataclasses.replace(options, mesh=mesh, expert_parallel=parallel.enable_expert_parallel)


@dataclasses.dataclass(frozen=True)
class NodeWeightBytes:
    """Bytes of a model's weights: on this process's devices (every local copy counted) and in the
    model (each weight once), for all weights and for the routed experts alone."""

    local: int
    total: int
    local_experts: int
    total_experts: int


def node_weight_bytes(model_state: nnx.State) -> NodeWeightBytes:
    """What this process's devices hold of `model_state`: with expert parallelism over several
    processes each holds its share of the routed experts, the rest is copied where replicated."""
    counts = np.zeros(4, np.int64)
    for _, variable in nnx.to_flat_state(model_state):
        array = variable.get_value()
        local = sum(shard.data.nbytes for shard in array.addressable_shards)
        experts = EXPERTS in (variable.get_metadata().get("axes") or ())
        counts += (local, array.nbytes, local * experts, array.nbytes * experts)
    return NodeWeightBytes(*map(int, counts))
