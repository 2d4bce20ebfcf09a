"""Paged KV-cache state: per-pool pytrees of planes, block tables and compressor-state slots.

Built from a static `PagedCacheLayout` (hashable: usable as a jit static argument) in two steps:
`abstract_paged_cache` gives the pytree of `jax.ShapeDtypeStruct`s with their shardings (what the
sharding code and `jax.eval_shape` consume), and `init_paged_cache` materialises it in one jitted
function with those `out_shardings`. The step functions take the cache as a value and return the
new one; jit them with `donate_argnums` so XLA updates the buffers in place
(`reset_slots_donated` is such a function).

Layout (every plane is `[layers of the pool, blocks, units per block, ...]`):

* ``sliding``: window KV of every attention layer, `block_size` tokens per block. A sequence's
  row of `block_table` is a ring of ceil(window / block) + 1 blocks: position t lives in
  `block_table[slot, (t // block_size) % ring]`, offset `t % block_size`.
* ``compressed``: CSA entries (`block_size / csa_ratio` per block), their indexer keys, and HCA
  entries (`block_size / hca_ratio` per block). All three count the same token positions in
  blocks of `block_size`, so one block table and one block-id space serve them: block id k names
  the same 256 positions of a sequence in each. CSA entry j lives in
  `block_table[slot, j // (block_size / csa_ratio)]`.
* ``state``: fp32 compressor state, one fixed slot per sequence (kv rows, and score rows that
  start at -inf), for the CSA main and indexer compressors and the HCA compressor.

KV planes are `Fp8DsMlaPlanes` (e4m3 nope, bf16 rope, uint8 UE8M0 scales), `Bf16Rows` or
`Float32Rows` (the exact reference cache, xla backend only); indexer planes are
`IndexerFp8Planes` (e4m3 keys, fp32 scale), `IndexerBf16Rows` or `IndexerFloat32Rows`;
`kv_planes` and `indexer_planes` are the one definition of their dtypes and shapes. Block
tables hold `NO_BLOCK` (-1) where no block is assigned. With data-parallel attention the block axis of every
plane, and the slot axis of block tables and state, are sharded over the data axis: each rank
owns its blocks and sequence slots, and block ids in its tables are local to it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4_jax.config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4_jax.kv_cache.planes import (  # noqa: F401  (the planes are part of the cache's vocabulary)
    Bf16Rows, Float32Rows, Fp8DsMlaPlanes, IndexerBf16Rows, IndexerFloat32Rows, IndexerFp8Planes, IndexerPlanes,
    KVPlanes, indexer_planes, kv_planes,
)
from dsv4_jax.kv_cache.planner import (
    CapacityPlan,
    _check_block_size,
    hca_ratio,
    layer_groups,
    sliding_blocks_per_seq,
)
from dsv4_jax.kv_cache.pytrees import pytree_dataclass
from dsv4_jax.kv_cache.resolver import KVCacheSpec
from pallas_kernels import formats

NO_BLOCK = -1


@pytree_dataclass
class SlidingPool:
    kv: Any  # KVPlanes, L = all attention layers, `block_size` tokens per block
    block_table: Any  # [slots, ring] int32


@pytree_dataclass
class CompressedPools:
    csa: Any  # KVPlanes or None
    indexer: Any  # IndexerPlanes or None
    hca: Any  # KVPlanes or None
    block_table: Any  # [slots, max_blocks_per_seq] int32


@pytree_dataclass
class CompressorState:
    kv: Any  # [L, slots, K*r, c*d] float32: a ring of K windows (model/cache_step.py)
    score: Any  # [L, slots, K*r, c*d] float32, -inf where empty


@pytree_dataclass
class PagedKVCache:
    sliding: Any  # SlidingPool
    compressed: Any  # CompressedPools
    csa_state: Any  # CompressorState or None
    csa_indexer_state: Any  # CompressorState or None
    hca_state: Any  # CompressorState or None


@dataclasses.dataclass(frozen=True)
class PagedCacheLayout:
    """Static description of one rank's paged cache (hashable)."""

    kv_cache_dtype: str
    indexer_dtype: str
    head_dim: int
    rope_dim: int
    index_head_dim: int
    block_size: int
    window: int
    csa_ratio: int
    hca_ratio: int
    sliding_layers: tuple[int, ...]
    csa_layers: tuple[int, ...]
    hca_layers: tuple[int, ...]
    num_seq_slots: int
    num_sliding_blocks: int
    num_compressed_blocks: int
    max_blocks_per_seq: int
    # Data-parallel ranks whose pools lie side by side along the block axis (the runner's whole
    # layout): a kernel sees one rank's share, so idle layers are sized from that share.
    data_parallel: int = 1
    # Compressor windows a slot keeps beyond those its compressor reads (2 on CSA, 1 on HCA): 1
    # when speculative decoding may take a sequence back into the window before (its drafts are
    # at most one compression ratio long), else 0 (model/cache_step.py).
    spare_compressor_windows: int = 0

    def __post_init__(self) -> None:
        for name in ("num_seq_slots", "num_sliding_blocks", "num_compressed_blocks", "max_blocks_per_seq",
                     "data_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedCacheLayout.{name} must be a positive integer, got {value!r}")
        spare = self.spare_compressor_windows
        if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
            raise ValueError(f"PagedCacheLayout.spare_compressor_windows must be a non-negative integer, got {spare!r}")
        if self.num_sliding_blocks < self.num_seq_slots * self.sliding_ring:
            raise ValueError(
                f"PagedCacheLayout.num_sliding_blocks ({self.num_sliding_blocks}) must hold one ring of "
                f"{self.sliding_ring} blocks for each of the {self.num_seq_slots} sequence slots"
            )

    @property
    def sliding_ring(self) -> int:
        """Sliding blocks of one sequence slot: ceil(window / block) + 1, or fewer when no sequence
        spans that many blocks (as the planner sizes the pool): a ring that long never wraps."""
        return min(sliding_blocks_per_seq(self.window, self.block_size), self.max_blocks_per_seq)

    @property
    def csa_units_per_block(self) -> int:
        return self.block_size // self.csa_ratio

    @property
    def hca_units_per_block(self) -> int:
        return self.block_size // self.hca_ratio

    def layer_index(self, layer: int) -> dict[str, int]:
        """Where model layer `layer` sits on each pool's layer axis."""
        out = {"sliding": self.sliding_layers.index(layer)}
        if layer in self.csa_layers:
            out["csa"] = self.csa_layers.index(layer)
        if layer in self.hca_layers:
            out["hca"] = self.hca_layers.index(layer)
        return out

    @classmethod
    def build(
        cls,
        config: DeepseekV4Config,
        spec: KVCacheSpec,
        *,
        max_model_len: int,
        num_seq_slots: int,
        num_compressed_blocks: int | None = None,
        num_sliding_blocks: int | None = None,
        block_size: int = 256,
        num_mtp_layers: int = 0,
        spare_compressor_windows: int = 0,
    ) -> "PagedCacheLayout":
        """Defaults size the pools for `num_seq_slots` sequences of `max_model_len` tokens (+1 block each)."""
        _check_block_size(config, block_size)
        groups = layer_groups(config, num_mtp_layers)
        max_blocks = math.ceil(max_model_len / block_size)
        ring = sliding_blocks_per_seq(config.sliding_window, block_size)
        return cls(
            kv_cache_dtype=spec.kv_cache_dtype,
            indexer_dtype=spec.indexer_dtype,
            head_dim=config.head_dim,
            rope_dim=config.qk_rope_head_dim,
            index_head_dim=config.index_head_dim,
            block_size=block_size,
            window=config.sliding_window,
            csa_ratio=config.csa_compress_ratio,
            hca_ratio=hca_ratio(config),
            sliding_layers=groups[SLIDING],
            csa_layers=groups[CSA],
            hca_layers=groups[HCA],
            num_seq_slots=num_seq_slots,
            num_sliding_blocks=num_sliding_blocks or num_seq_slots * ring,
            num_compressed_blocks=num_compressed_blocks or math.ceil(num_seq_slots * max_model_len / block_size)
            + num_seq_slots,
            max_blocks_per_seq=max_blocks,
            spare_compressor_windows=spare_compressor_windows,
        )

    @classmethod
    def from_plan(cls, config: DeepseekV4Config, plan: CapacityPlan) -> "PagedCacheLayout":
        return cls.build(
            config, plan.spec, max_model_len=plan.max_model_len, num_seq_slots=plan.num_seq_slots,
            num_compressed_blocks=plan.num_blocks["compressed"], num_sliding_blocks=plan.num_blocks["sliding"],
            block_size=plan.block_size, num_mtp_layers=plan.num_mtp_layers,
            spare_compressor_windows=plan.spare_compressor_windows,
        )


# ---- the abstract description -----------------------------------------------------------------
def _describe(layout: PagedCacheLayout, make, make_table, make_state) -> PagedKVCache:
    """The cache pytree with leaves built by `make(shape, dtype)` (tables and state by their own)."""
    slots = layout.num_seq_slots
    nb_c = layout.num_compressed_blocks
    n_csa, n_hca = len(layout.csa_layers), len(layout.hca_layers)
    csa = indexer = hca = None

    def kv(lead: tuple[int, ...]) -> KVPlanes:
        return kv_planes(layout.kv_cache_dtype, lead, layout.head_dim, layout.rope_dim, make, layout.data_parallel)

    if n_csa:
        csa = kv((n_csa, nb_c, layout.csa_units_per_block))
        indexer = indexer_planes(
            layout.indexer_dtype, (n_csa, nb_c, layout.csa_units_per_block), layout.index_head_dim, make,
            layout.data_parallel,
        )
    if n_hca:
        hca = kv((n_hca, nb_c, layout.hca_units_per_block))

    def state(layers: int, ratio: int, dim: int, overlap: bool):
        if not layers:
            return None
        c = 2 if overlap else 1
        shape = (layers, slots, (c + layout.spare_compressor_windows) * ratio, c * dim)
        return CompressorState(kv=make_state(shape, 0.0), score=make_state(shape, -jnp.inf))

    return PagedKVCache(
        sliding=SlidingPool(
            kv=kv((len(layout.sliding_layers), layout.num_sliding_blocks, layout.block_size)),
            block_table=make_table((slots, layout.sliding_ring)),
        ),
        compressed=CompressedPools(
            csa=csa, indexer=indexer, hca=hca, block_table=make_table((slots, layout.max_blocks_per_seq))
        ),
        csa_state=state(n_csa, layout.csa_ratio, layout.head_dim, True),
        csa_indexer_state=state(n_csa, layout.csa_ratio, layout.index_head_dim, True),
        hca_state=state(n_hca, layout.hca_ratio, layout.head_dim, False),
    )


def partition_specs(layout: PagedCacheLayout, data_axis: str | None = None) -> PagedKVCache:
    """PartitionSpecs of every leaf: the block axis of planes and the slot axis of tables and state
    on `data_axis` (data-parallel attention); everything else replicated (TP ranks each hold the
    whole cache: DeepSeek-V4 has one KV head)."""
    return _describe(
        layout,
        make=lambda shape, dtype: P(None, data_axis, *([None] * (len(shape) - 2))),
        make_table=lambda shape: P(data_axis, None),
        make_state=lambda shape, fill: P(None, data_axis, None, None),
    )


def paged_cache_shardings(layout: PagedCacheLayout, mesh: Mesh, data_axis: str | None = None) -> PagedKVCache:
    """NamedShardings on `mesh`; ValueError if `data_axis` does not divide blocks and slots."""
    if data_axis is not None:
        if data_axis not in mesh.axis_names:
            raise ValueError(f"data axis {data_axis!r} is not an axis of the mesh {mesh.axis_names}")
        size = mesh.shape[data_axis]
        for name in ("num_seq_slots", "num_sliding_blocks", "num_compressed_blocks"):
            if getattr(layout, name) % size:
                raise ValueError(
                    f"{name}={getattr(layout, name)} must be a multiple of the {size} data-parallel ranks "
                    f"of mesh axis {data_axis!r}"
                )
    specs = partition_specs(layout, data_axis)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def abstract_paged_cache(layout: PagedCacheLayout, shardings: PagedKVCache | None = None) -> PagedKVCache:
    """The cache as `jax.ShapeDtypeStruct`s (with `shardings` when given): nothing is allocated."""
    desc = _describe(
        layout,
        make=lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype),
        make_table=lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32),
        make_state=lambda shape, fill: jax.ShapeDtypeStruct(shape, jnp.float32),
    )
    if shardings is None:
        return desc
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), desc, shardings,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )


def _materialise(layout: PagedCacheLayout) -> PagedKVCache:
    return _describe(
        layout,
        make=lambda shape, dtype: jnp.zeros(shape, dtype),
        make_table=lambda shape: jnp.full(shape, NO_BLOCK, jnp.int32),
        make_state=lambda shape, fill: jnp.full(shape, fill, jnp.float32),
    )


@functools.lru_cache(maxsize=16)
def _init_fn(layout: PagedCacheLayout, shardings: Any):
    return jax.jit(functools.partial(_materialise, layout), out_shardings=shardings)


def init_paged_cache(layout: PagedCacheLayout, mesh: Mesh | None = None, data_axis: str | None = None) -> PagedKVCache:
    """Allocate the cache in one jitted function, straight into its shardings (zeros, tables -1,
    compressor scores -inf). Without a mesh it lands on the default device."""
    shardings = paged_cache_shardings(layout, mesh, data_axis) if mesh is not None else None
    return _init_fn(layout, shardings)()


def cache_nbytes(tree: PagedKVCache) -> int:
    """Bytes of all leaves (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ---- slot arithmetic and reference reads/writes ------------------------------------------------
def sliding_slots(block_table_row: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
    """Flat slots (block * block_size + offset) of token positions in a sequence's sliding ring;
    -1 where the ring entry has no block."""
    ring = block_table_row.shape[-1]
    block = jnp.take(block_table_row, (positions // block_size) % ring, axis=-1)
    return jnp.where(block < 0, -1, block * block_size + positions % block_size)


def compressed_slots(block_table_row: jax.Array, entries: jax.Array, units_per_block: int) -> jax.Array:
    """Flat slots of compressed entries (CSA or HCA numbering) of one sequence; -1 if unassigned."""
    idx = entries // units_per_block
    block = jnp.take(block_table_row, jnp.minimum(idx, block_table_row.shape[-1] - 1), axis=-1)
    block = jnp.where(idx < block_table_row.shape[-1], block, -1)
    return jnp.where(block < 0, -1, block * units_per_block + entries % units_per_block)


def _split(slots: jax.Array, blocks: int, units: int) -> tuple[jax.Array, jax.Array]:
    """Flat slots -> (block, offset); invalid slots (-1 or past the pool) -> block `blocks` (dropped)."""
    bad = (slots < 0) | (slots >= blocks * units)
    return jnp.where(bad, blocks, slots // units), jnp.where(bad, 0, slots % units)


def read_kv(planes: KVPlanes, slots: jax.Array, layer: int | jax.Array = 0, dtype=jnp.float32) -> jax.Array:
    """Dequantised rows [T, head_dim] at flat `slots` [T] of pool layer `layer`; zeros where a
    slot is < 0."""
    if isinstance(planes, Fp8DsMlaPlanes):
        _, blocks, units, _ = planes.nope.shape
        blk, off = _split(slots, blocks, units)
        blk = jnp.minimum(blk, blocks - 1)
        out = formats.fp8_ds_mla_dequantize(
            planes.nope[layer, blk, off], planes.rope[layer, blk, off], planes.scales[layer, blk, off], dtype
        )
    else:
        _, blocks, units, _ = planes.rows.shape
        blk, off = _split(slots, blocks, units)
        rows = planes.rows[layer, jnp.minimum(blk, blocks - 1), off]
        if isinstance(planes, Float32Rows):
            out = formats.float32_rows_dequantize(rows, dtype)
        else:
            out = formats.bf16_rows_dequantize(rows, dtype)
    return jnp.where((slots >= 0)[:, None], out, jnp.zeros((), dtype))


def read_indexer(
    planes: IndexerPlanes, slots: jax.Array, layer: int | jax.Array = 0, dtype=jnp.float32
) -> jax.Array:
    """Dequantised indexer keys [T, index_head_dim] at flat `slots` [T] (bf16 and float32 keys read
    exactly); zeros where a slot is < 0."""
    _, blocks, units, _ = planes.keys.shape
    blk, off = _split(slots, blocks, units)
    blk = jnp.minimum(blk, blocks - 1)
    if isinstance(planes, IndexerFp8Planes):
        out = formats.indexer_fp8_dequantize(planes.keys[layer, blk, off], planes.scales[layer, blk, off], dtype)
    else:
        out = planes.keys[layer, blk, off].astype(dtype)
    return jnp.where((slots >= 0)[:, None], out, jnp.zeros((), dtype))


def reset_slots(cache: PagedKVCache, slots: jax.Array) -> PagedKVCache:
    """Free sequence slots for new sequences: their block-table rows become NO_BLOCK and their
    compressor state is cleared (kv 0, score -inf). Slots < 0 are ignored (padding)."""
    n = cache.sliding.block_table.shape[0]
    rows = jnp.where(slots < 0, n, slots)

    def clear_table(table):
        return table.at[rows].set(NO_BLOCK, mode="drop")

    def clear_state(state):
        if state is None:
            return None
        return CompressorState(
            kv=state.kv.at[:, rows].set(0.0, mode="drop"), score=state.score.at[:, rows].set(-jnp.inf, mode="drop")
        )

    return dataclasses.replace(
        cache,
        sliding=dataclasses.replace(cache.sliding, block_table=clear_table(cache.sliding.block_table)),
        compressed=dataclasses.replace(cache.compressed, block_table=clear_table(cache.compressed.block_table)),
        csa_state=clear_state(cache.csa_state),
        csa_indexer_state=clear_state(cache.csa_indexer_state),
        hca_state=clear_state(cache.hca_state),
    )


reset_slots_donated = jax.jit(reset_slots, donate_argnums=0)
