"""The planes of the KV pools: one dataclass per storage layout, and `kv_planes` /
`indexer_planes`, the one definition of their dtypes and shapes (for the paged cache, the capacity
planner's byte counts and the kernels' tests).

KV planes are `Fp8DsMlaPlanes` (e4m3 nope, bf16 rope, uint8 UE8M0 scales), `Bf16Rows` or
`Float32Rows` (the exact reference cache, xla backend only); indexer planes are
`IndexerFp8Planes` (e4m3 keys, fp32 scale), `IndexerBf16Rows` or `IndexerFloat32Rows`. Every
plane is `[layers of the pool, blocks, units per block, ...]`.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import jax.numpy as jnp

from dsv4_jax.kv_cache.pytrees import pytree_dataclass
from dsv4_jax.kv_cache.resolver import BFLOAT16, FLOAT32, FP8_DS_MLA
from pallas_kernels import formats


@pytree_dataclass
class Fp8DsMlaPlanes:
    nope: Any  # [L, blocks, units, nope] float8_e4m3fn
    rope: Any  # [L, blocks, units, rope] bfloat16
    scales: Any  # [L, blocks, units, scale_bytes] uint8 (UE8M0, padding bytes 0)


@pytree_dataclass
class Bf16Rows:
    rows: Any  # [L, blocks, units, head_dim] bfloat16


@pytree_dataclass
class Float32Rows:
    rows: Any  # [L, blocks, units, head_dim] float32


@pytree_dataclass
class IndexerFp8Planes:
    keys: Any  # [L, blocks, units, index_head_dim] float8_e4m3fn
    scales: Any  # [L, blocks, units] float32 (powers of two)


@pytree_dataclass
class IndexerBf16Rows:
    keys: Any  # [L, blocks, units, index_head_dim] bfloat16


@pytree_dataclass
class IndexerFloat32Rows:
    keys: Any  # [L, blocks, units, index_head_dim] float32


KVPlanes = Union[Fp8DsMlaPlanes, Bf16Rows, Float32Rows]
IndexerPlanes = Union[IndexerFp8Planes, IndexerBf16Rows, IndexerFloat32Rows]


def kv_planes(
    kv_cache_dtype: str,  # "fp8_ds_mla" | "bfloat16" | "float32"
    lead: tuple[int, ...],  # leading dims, [layers, blocks, units] in the cache
    head_dim: int,
    rope_dim: int,
    make: Callable[[tuple[int, ...], Any], Any] = jnp.zeros,
    ranks: int = 1,  # data-parallel ranks the blocks are split over (each kernel sees its share)
) -> KVPlanes:
    """The planes of a KV pool, each built by `make(shape, dtype)` (zeros by default): the one
    definition of their dtypes and shapes, for the cache and for the model's paged attention. A
    plane of 1-byte elements gets idle layers where a kernel would index it with wrapping offsets."""
    def plane(width: int, dtype) -> Any:
        return make((*formats.lead_with_idle_layers(lead, width, dtype, ranks), width), dtype)

    if kv_cache_dtype == FP8_DS_MLA:
        nope = head_dim - rope_dim
        return Fp8DsMlaPlanes(
            nope=plane(nope, jnp.float8_e4m3fn),
            rope=plane(rope_dim, jnp.bfloat16),
            scales=plane(formats.fp8_ds_mla_scale_bytes(nope), jnp.uint8),
        )
    if kv_cache_dtype == BFLOAT16:
        return Bf16Rows(rows=make((*lead, head_dim), jnp.bfloat16))
    if kv_cache_dtype == FLOAT32:
        return Float32Rows(rows=make((*lead, head_dim), jnp.float32))
    raise ValueError(
        f"kv_cache_dtype {kv_cache_dtype!r} has no pool planes; allowed: {FP8_DS_MLA!r}, {BFLOAT16!r}, {FLOAT32!r}"
    )


def indexer_planes(
    indexer_dtype: str,  # "fp8" | "bfloat16" | "float32"
    lead: tuple[int, ...],  # leading dims, [layers, blocks, units] in the cache
    index_head_dim: int,
    make: Callable[[tuple[int, ...], Any], Any] = jnp.zeros,
    ranks: int = 1,  # data-parallel ranks the blocks are split over
) -> IndexerPlanes:
    """The planes of an indexer-key pool (e4m3 keys + one fp32 scale per key, bf16 or float32 keys);
    e4m3 keys get idle layers as `kv_planes`' 1-byte planes do."""
    if indexer_dtype == "fp8":
        keys = formats.lead_with_idle_layers(lead, index_head_dim, jnp.float8_e4m3fn, ranks)
        return IndexerFp8Planes(keys=make((*keys, index_head_dim), jnp.float8_e4m3fn), scales=make(lead, jnp.float32))
    if indexer_dtype == BFLOAT16:
        return IndexerBf16Rows(keys=make((*lead, index_head_dim), jnp.bfloat16))
    if indexer_dtype == FLOAT32:
        return IndexerFloat32Rows(keys=make((*lead, index_head_dim), jnp.float32))
    raise ValueError(f"indexer_dtype {indexer_dtype!r} has no pool planes; allowed: 'fp8', {BFLOAT16!r}, {FLOAT32!r}")
