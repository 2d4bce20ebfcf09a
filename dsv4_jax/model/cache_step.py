"""What a cached step of the model reads and writes, besides the weights.

A step runs one group of sequences, `[batch, S]` tokens: each row is a chunk of one sequence at
its own absolute positions (S = 1: one decode token per row; S > 1: prefill chunks, where decode
tokens may ride along as rows of one real token). Padding rows have `lens` 0 and slot -1: they
read nothing and every write of theirs is dropped.

`StepSequences` carries the per-row arrays, `LayerPlace` the pool-layer indices of one model
layer (dynamic under `nnx.scan`), and `CacheStep` the static part: the cache layout and the
attention backend whose kernels read and write the pools.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.kv_cache.paged import (
    CompressorState,
    PagedCacheLayout,
    compressed_slots,
    sliding_slots,
)
from dsv4_jax.model.compressor import CompressorRows, PooledWindows
from dsv4_jax.kv_cache.pytrees import pytree_dataclass
from pallas_kernels.backend import AttentionBackend


@pytree_dataclass
class StepSequences:
    positions: jax.Array  # [batch, S] int32: start + s (padding rows: 0 + s)
    lens: jax.Array  # [batch] int32: real tokens per row
    slots: jax.Array  # [batch] int32: sequence slot (compressor state), -1 for padding rows
    sliding_table: jax.Array  # [batch, ring] int32: the row's sliding ring, -1 = no block
    compressed_table: jax.Array  # [batch, max_blocks] int32: compressed block ids, -1 = none

    @property
    def start(self) -> jax.Array:  # [batch] position of each row's first token
        return self.positions[:, 0]


@pytree_dataclass
class LayerPlace:
    """Where one model layer sits on each pool's layer axis (int32 scalars; 0 where unused)."""

    sliding: Any
    compressed: Any  # on the CSA pools for CSA layers, on the HCA pool for HCA layers


@dataclasses.dataclass(frozen=True)
class CacheStep:
    layout: PagedCacheLayout
    backend: AttentionBackend

    def places(self, layers: np.ndarray) -> LayerPlace:
        """Pool-layer indices of model layers `layers` (any int array shape) as int32 arrays."""
        lay = self.layout

        def index(layer: int) -> tuple[int, int]:
            where = lay.layer_index(int(layer))
            return where["sliding"], where.get("csa", where.get("hca", 0))

        pairs = np.array([index(layer) for layer in np.ravel(layers)], np.int32).reshape(*np.shape(layers), 2)
        return LayerPlace(sliding=jnp.asarray(pairs[..., 0]), compressed=jnp.asarray(pairs[..., 1]))


# ---- compressor state slots ----------------------------------------------------------------------
# A slot keeps a compressor's last K windows as a ring indexed by absolute window: window w lies in
# rows [(w % K) * ratio, (w % K + 1) * ratio), token t at row (t // ratio % K) * ratio + t % ratio.
# Where a sequence stands is then all a step needs to find its windows, so a step that moves it
# back (rejected speculative drafts) needs no undo: the windows before it are still in place (K is
# one more than the compressor reads when the cache serves speculation, PagedCacheLayout), and
# what the drafts wrote past it is overwritten before anything pools it.
def ring_order(window: jax.Array, ratio: int, windows: int) -> jax.Array:
    """[batch, windows * ratio] int32: the ring row of each timeline row, the timeline holding
    windows `window` [batch] - windows + 1 .. `window` in order."""
    line = jnp.arange(windows * ratio)
    absolute = window[:, None] - (windows - 1) + line[None, :] // ratio
    return (absolute % windows) * ratio + line[None, :] % ratio


def timeline_rows(state: CompressorState, layer: jax.Array, slots: jax.Array, start: jax.Array, ratio: int
                  ) -> CompressorRows:
    """Each sequence's kept windows in timeline order, the window of `start` [batch] last
    ([batch, K*r, c*d]; padding rows read slot 0)."""
    safe = jnp.maximum(slots, 0)
    kv, score = state.kv[layer, safe], state.score[layer, safe]
    order = ring_order(start // ratio, ratio, kv.shape[1] // ratio)[..., None]
    return CompressorRows(jnp.take_along_axis(kv, order, axis=1), jnp.take_along_axis(score, order, axis=1))


def kept_rows(state: CompressorState, layer: jax.Array, seqs: StepSequences, ratio: int) -> CompressorRows:
    """The rows each sequence's compressor kept, in timeline order. A row at position 0 starts a
    sequence: it gets empty rows whatever the slot held before (a slot is reused without being
    cleared), and so do padding rows; so do the windows before a sequence's window 0."""
    rows = timeline_rows(state, layer, seqs.slots, seqs.start, ratio)
    pad = ((seqs.slots < 0) | (seqs.start == 0))[:, None, None]
    rows = CompressorRows(jnp.where(pad, 0.0, rows.kv), jnp.where(pad, -jnp.inf, rows.score))
    return rows.without_windows_before_0(seqs.start, ratio)


def store_rows(state: CompressorState, layer: jax.Array, slots: jax.Array, end: jax.Array, ratio: int,
               rows: CompressorRows) -> CompressorState:
    """Write the rows a chunk keeps (timeline order, the window of `end` [batch] last) into each
    sequence's ring; padding rows (slot -1) are dropped."""
    target = jnp.where(slots < 0, state.kv.shape[1], slots)[:, None]
    order = ring_order(end // ratio, ratio, rows.kv.shape[1] // ratio)
    return CompressorState(
        kv=state.kv.at[layer, target, order].set(rows.kv, mode="drop"),
        score=state.score.at[layer, target, order].set(rows.score, mode="drop"),
    )


def store_token_row(
    state: CompressorState,
    layer: jax.Array,
    slots: jax.Array,  # [batch] int32, -1 for padding rows (dropped)
    position: jax.Array,  # [batch] int32: each sequence's token
    ratio: int,
    kv: jax.Array,  # [batch, c*d] float32
    score: jax.Array,  # [batch, c*d] float32
) -> CompressorState:
    """One decode token's row per sequence, at its ring row (the other rows stay as they are)."""
    target = jnp.where(slots < 0, state.kv.shape[1], slots)
    row = ring_order(position // ratio, ratio, state.kv.shape[2] // ratio)[:, -ratio:]
    row = jnp.take_along_axis(row, (position % ratio)[:, None], axis=1)[:, 0]
    return CompressorState(
        kv=state.kv.at[layer, target, row].set(kv, mode="drop"),
        score=state.score.at[layer, target, row].set(score, mode="drop"),
    )


# ---- flat pool slots -----------------------------------------------------------------------------
def entry_slots(table: jax.Array, windows: PooledWindows, units_per_block: int) -> jax.Array:
    """Flat slots [batch * E] of the entries a chunk completed; -1 where none was completed."""
    slots = jax.vmap(compressed_slots, in_axes=(0, 0, None))(table, windows.entry_ids, units_per_block)
    return jnp.where(windows.valid, slots, -1).reshape(-1)


def window_slots(seqs: StepSequences, block_size: int, keep_last: int) -> jax.Array:
    """Flat sliding-ring slots [batch * S] of the rows a later step reads: the last `keep_last`
    real tokens of each row (a ring holds ceil(window / block) + 1 blocks, so writing more could
    overwrite a row before it is read, or write one slot twice in an undefined order)."""
    s = jnp.arange(seqs.positions.shape[1])[None, :]
    wanted = (s < seqs.lens[:, None]) & (s >= seqs.lens[:, None] - keep_last)
    slots = jax.vmap(sliding_slots, in_axes=(0, 0, None))(seqs.sliding_table, seqs.positions, block_size)
    return jnp.where(wanted, slots, -1).reshape(-1)
