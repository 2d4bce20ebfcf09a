"""The attention core on a KV-cache backend: the full-sequence model's attention through the
same kernels the engine uses (`pallas_kernels.backend`: `xla`, `pallas_fp8_ds_mla`, `pallas_bf16`).

The sequence's own K=V rows go to the prefill kernel directly (`window_kv`, as the cache stores
them), and its compressed entries are written into a paged pool with the backend's `write_kv`
(quantising to fp8_ds_mla or bf16 rows, or storing float32 rows exactly) and read back by the
kernel through a block table. With `kv_cache_rounding` on, the model's KV is already on the fp8
grid, so the fp8_ds_mla backend must reproduce the dense reference up to the kernel's bf16 dot
operands; with float32 pools (xla backend) nothing is rounded, so it reproduces the dense
reference up to fp32 summation order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dsv4_jax.kv_cache.paged import KVPlanes, indexer_planes, kv_planes
from dsv4_jax.kv_cache.resolver import BFLOAT16, FP8_DS_MLA
from pallas_kernels.backend import AttentionBackend, get_backend


@dataclasses.dataclass(frozen=True)
class PagedAttentionCore:
    """An `AttentionCore` that runs the backend's prefill kernel over paged pools."""

    backend_name: str
    rope_dim: int
    block_size: int = 16  # compressed entries per pool block
    kv_cache_dtype: str | None = None  # the resolved KVCacheSpec.kv_cache_dtype; None: the backend's format
    indexer_dtype: str | None = None  # the resolved KVCacheSpec.indexer_dtype; None: follows the KV format

    @property
    def backend(self) -> AttentionBackend:
        return get_backend(self.backend_name)

    def _empty_pool(self, blocks: int, head_dim: int) -> KVPlanes:
        """A zeroed one-layer pool [1, blocks, block_size, ...] in `kv_cache_dtype`, else in the
        backend's KV format (the xla backend reads any; it gets fp8_ds_mla, the format the model's
        KV rounding matches)."""
        return kv_planes(self._kv_dtype, (1, blocks, self.block_size), head_dim, self.rope_dim)

    @property
    def _kv_dtype(self) -> str:
        return self.kv_cache_dtype or (BFLOAT16 if self.backend.kv_format == "bf16" else FP8_DS_MLA)

    @property
    def _indexer_dtype(self) -> str:
        return self.indexer_dtype or {FP8_DS_MLA: "fp8"}.get(self._kv_dtype, self._kv_dtype)

    @staticmethod
    def _paged(batch: int, entries: int, block_size: int) -> tuple[int, jax.Array, jax.Array]:
        """Blocks per sequence, block table [batch, per_seq] and the entries' flat slots [batch * entries]."""
        per_seq = math.ceil(entries / block_size)
        table = jnp.arange(batch * per_seq, dtype=jnp.int32).reshape(batch, per_seq)
        slots = (jnp.arange(batch)[:, None] * per_seq * block_size + jnp.arange(entries)).reshape(-1)
        return per_seq, table, slots.astype(jnp.int32)

    def select_entries(
        self,
        q: jax.Array,  # [batch, seq, index_heads, index_head_dim] rotated indexer queries
        weights: jax.Array,  # [batch, seq, index_heads] fp32 head weights
        keys: jax.Array,  # [batch, entries, index_head_dim] indexer keys (not rounded)
        *,
        topk: int,
        ratio: int,
    ) -> jax.Array:  # [batch, seq, topk] int32, -1 = none
        """The CSA entries each query reads, picked as the cache picks them: the keys are stored
        in an indexer pool of `indexer_dtype` with the backend's `write_indexer_keys` (which
        rounds them as the cache does) and ranked by its `indexer_topk`."""
        batch, seq = q.shape[:2]
        entries, dim = keys.shape[1:]
        if entries == 0:
            return jnp.full((batch, seq, topk), -1, jnp.int32)
        per_seq, table, slots = self._paged(batch, entries, self.block_size)
        pool = indexer_planes(self._indexer_dtype, (1, batch * per_seq, self.block_size), dim)
        pool = self.backend.write_indexer_keys(pool, keys.reshape(batch * entries, dim), slots)
        starts, lens = jnp.zeros((batch,), jnp.int32), jnp.full((batch,), seq, jnp.int32)
        return self.backend.indexer_topk(q, weights, pool, table, starts, lens, topk=topk, ratio=ratio)

    def __call__(
        self,
        q: jax.Array,  # [batch, seq, heads, head_dim]
        window_kv: jax.Array,  # [batch, seq, head_dim]
        compressed_kv: jax.Array | None,  # [batch, entries, head_dim]
        compressed_idx: jax.Array | None,  # [batch, seq, topk] (CSA) or None (HCA)
        sinks: jax.Array,  # [heads]
        *,
        window: int,
        ratio: int,
    ) -> jax.Array:  # [batch, seq, heads, head_dim] float32
        batch, seq, _, head_dim = q.shape
        backend = self.backend
        # Every window row comes from `window_kv`; the sliding pool is an unused single block.
        window_pool = self._empty_pool(1, head_dim)
        window_table = jnp.full((batch, 1), -1, jnp.int32)
        starts = jnp.zeros((batch,), jnp.int32)
        lens = jnp.full((batch,), seq, jnp.int32)
        pool = table = None
        if compressed_kv is not None and compressed_kv.shape[1] > 0:
            entries = compressed_kv.shape[1]
            per_seq, table, slots = self._paged(batch, entries, self.block_size)
            pool = self._empty_pool(batch * per_seq, head_dim)
            pool = backend.write_kv(pool, compressed_kv.reshape(batch * entries, head_dim), slots)
        else:
            compressed_idx = None
        return backend.prefill(
            q, window_pool, window_table, starts, lens, sinks, pool, table,
            None if compressed_idx is None else compressed_idx.astype(jnp.int32),
            window_kv=window_kv, window=window, ratio=ratio if pool is not None else 0,
        )
