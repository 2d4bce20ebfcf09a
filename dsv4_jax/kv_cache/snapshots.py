"""Prefix-cache snapshots: the per-slot state a sequence needs to resume at a block boundary.

Compressed blocks are shared between sequences by reference (`engine/block_manager.py`); what a
slot owns is not: its sliding ring and its compressor state. A sequence that resumes at block
boundary h reads, from its slot, the sliding rows of positions [h - window + 1, h) of every
attention layer (position h's window is itself and the window - 1 before it) and the CSA and
CSA-indexer compressor rows (at a boundary only the previous window's rows are read, for the
overlap). HCA's state holds nothing a boundary needs: its windows divide the block size, and
its rows are each written before they are pooled.

A snapshot holds exactly that, `[layers, snapshots, ...]` per pool: `take_snapshots` copies it
out of slots right after the step that ended at h, `restore_snapshots` into a new slot before its
first step. Positions before 0 (h < window - 1) are neither copied nor restored. Ring addresses
are the same in every slot (a position's ring entry depends on the position only), so a snapshot
goes into any slot.

Memory per snapshot: sliding layers x (window - 1) KV rows, plus CSA layers x (K csa_ratio) x 2
(kv and score) x 4 (float32) x (2 head_dim + 2 index_head_dim) bytes, K = 2 (3 with speculative
decoding's spare window; the sliding layers then include the MTP layer) (`snapshot_bytes`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.kv_cache.paged import CompressorState, PagedCacheLayout, PagedKVCache, abstract_paged_cache
from dsv4_jax.kv_cache.pytrees import pytree_dataclass


@pytree_dataclass
class PrefixSnapshots:
    sliding: object  # the sliding planes' pytree, each leaf [sliding layers, snapshots, window - 1, ...]
    csa_state: object  # CompressorState [CSA layers, snapshots, K ratio, 2 head_dim] or None (K: the cache's)
    csa_indexer_state: object  # CompressorState [CSA layers, snapshots, K ratio, 2 index_head_dim] or None


def snapshot_rows(layout: PagedCacheLayout) -> int:
    """Sliding rows a snapshot keeps per layer: the window before a boundary, less the boundary's own."""
    return layout.window - 1


def abstract_snapshots(layout: PagedCacheLayout, num_snapshots: int) -> PrefixSnapshots:
    """The snapshots' shapes and dtypes (`jax.ShapeDtypeStruct`s), for one rank's layout."""
    cache = abstract_paged_cache(layout)
    layers = len(layout.sliding_layers)
    rows = snapshot_rows(layout)

    def sliding(leaf):  # without the idle layers a kernel's plane may carry
        return jax.ShapeDtypeStruct((layers, num_snapshots, rows, *leaf.shape[3:]), leaf.dtype)

    def state(s):
        if s is None:
            return None
        shape = (s.kv.shape[0], num_snapshots, *s.kv.shape[2:])
        return CompressorState(jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.float32))

    return PrefixSnapshots(jax.tree.map(sliding, cache.sliding.kv), state(cache.csa_state),
                           state(cache.csa_indexer_state))


def snapshot_bytes(layout: PagedCacheLayout) -> int:
    """Bytes of one snapshot."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract_snapshots(layout, 1)))


def init_snapshots(layout: PagedCacheLayout, num_snapshots: int, shardings=None) -> PrefixSnapshots:
    """Zeroed snapshots (their contents are only read once written), made by one program straight
    into `shardings` (a pytree of them, or None: the default device)."""
    shapes = abstract_snapshots(layout, num_snapshots)
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=shardings)()


def snapshot_partition_specs(snapshots: PrefixSnapshots, data_axis: str | None) -> PrefixSnapshots:
    """The snapshot axis of every leaf on `data_axis`: each data-parallel rank keeps its own."""
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda x: P(None, data_axis, *([None] * (len(x.shape) - 2))), snapshots)


def _ring_addresses(layout: PagedCacheLayout, slots: jax.Array, ends: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(flat sliding block [E, R], offset [E, R]) of positions [end - R, end) in each slot's ring,
    block -1 where the position is before 0 or the entry is padding (slot < 0)."""
    rows, bs, ring = snapshot_rows(layout), layout.block_size, layout.sliding_ring
    positions = ends[:, None] - rows + jnp.arange(rows)[None, :]  # [E, R]
    block = slots[:, None] * ring + (positions // bs) % ring
    valid = (positions >= 0) & (slots[:, None] >= 0)
    return jnp.where(valid, block, -1), positions % bs


def take_snapshots(layout: PagedCacheLayout, cache: PagedKVCache, snapshots: PrefixSnapshots,
                   slots: jax.Array, snap_ids: jax.Array, ends: jax.Array) -> PrefixSnapshots:
    """Copy each slot's state at block boundary `ends[e]` into snapshot `snap_ids[e]` (entries
    with snap_id < 0 are padding). slots, snap_ids, ends: [E] int32."""
    layers = len(layout.sliding_layers)
    block, offset = _ring_addresses(layout, slots, ends)
    target = jnp.where(snap_ids < 0, snapshots_count(snapshots), snap_ids)
    safe_block = jnp.maximum(block, 0)

    def copy_rows(pool, kept):  # pool [L+idle, blocks, bs, ...], kept [L, n, R, ...]
        rows = pool[:layers, safe_block, offset]  # [L, E, R, ...]
        return kept.at[:, target].set(rows, mode="drop")

    def copy_state(state, kept):
        if state is None:
            return None
        safe = jnp.maximum(slots, 0)
        return CompressorState(kept.kv.at[:, target].set(state.kv[:, safe], mode="drop"),
                               kept.score.at[:, target].set(state.score[:, safe], mode="drop"))

    return PrefixSnapshots(
        jax.tree.map(copy_rows, cache.sliding.kv, snapshots.sliding),
        copy_state(cache.csa_state, snapshots.csa_state),
        copy_state(cache.csa_indexer_state, snapshots.csa_indexer_state),
    )


def restore_snapshots(layout: PagedCacheLayout, cache: PagedKVCache, snapshots: PrefixSnapshots,
                      slots: jax.Array, snap_ids: jax.Array, starts: jax.Array) -> PagedKVCache:
    """Copy snapshot `snap_ids[e]` into slot `slots[e]`, which resumes at block boundary
    `starts[e]` (entries with snap_id < 0 are padding). slots, snap_ids, starts: [E] int32."""
    layers = len(layout.sliding_layers)
    live = snap_ids >= 0
    block, offset = _ring_addresses(layout, jnp.where(live, slots, -1), starts)
    source = jnp.maximum(snap_ids, 0)

    def put_rows(pool, kept):
        dropped = jnp.where(block < 0, pool.shape[1], block)
        return pool.at[:layers, dropped, offset].set(kept[:, source], mode="drop")

    def put_state(state, kept):
        if state is None:
            return None
        target = jnp.where(live & (slots >= 0), slots, state.kv.shape[1])
        return CompressorState(state.kv.at[:, target].set(kept.kv[:, source], mode="drop"),
                               state.score.at[:, target].set(kept.score[:, source], mode="drop"))

    return dataclasses.replace(
        cache,
        sliding=dataclasses.replace(cache.sliding, kv=jax.tree.map(put_rows, cache.sliding.kv, snapshots.sliding)),
        csa_state=put_state(cache.csa_state, snapshots.csa_state),
        csa_indexer_state=put_state(cache.csa_indexer_state, snapshots.csa_indexer_state),
    )


def snapshots_count(snapshots: PrefixSnapshots) -> int:
    return jax.tree.leaves(snapshots)[0].shape[1]


def copy_entries(entries: list[tuple[int, int, int, int]], dp: int, per_rank: int) -> tuple[np.ndarray, ...]:
    """Host arrays of a copy call: `entries` (rank, slot, snapshot id, position) laid out as
    [dp * per_rank] (rank r's in [r per_rank, (r + 1) per_rank)), padding with snapshot id -1.
    Returns (slots, snap_ids, positions), each int32."""
    slots, snaps, positions = (np.full(dp * per_rank, fill, np.int32) for fill in (-1, -1, 0))
    used = [0] * dp
    for rank, slot, snap, position in entries:
        if used[rank] >= per_rank:
            raise ValueError(f"more than {per_rank} snapshot copies for data-parallel rank {rank} in one call")
        at = rank * per_rank + used[rank]
        slots[at], snaps[at], positions[at] = slot, snap, position
        used[rank] += 1
    return slots, snaps, positions
