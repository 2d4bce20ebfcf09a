"""The attention backend interface: one registry from backend name to the callables the model uses.

The KV resolver (dsv4_jax/kv_cache/resolver.py) picks a backend name; the model asks
`get_backend(name)` for an `AttentionBackend` and calls its functions, never a kernel directly:

* ``xla``: the pure-JAX references (they define the numerics; any device, any KV format,
  including float32 rows: the exact reference cache, where nothing is rounded);
* ``pallas_fp8_ds_mla``: the Pallas Triton kernels over fp8_ds_mla pools;
* ``pallas_bf16``: the same kernels over bf16-row pools.

The Pallas backends refuse float32 pools (KV or indexer keys) with a ValueError naming the backend.

All functions take pools as tuples of planes (or the cache's plane dataclasses, e.g.
`Fp8DsMlaPlanes`: their fields in declaration order are the planes) and write functions return
the same type they were given. Kernels are written for one device: under a mesh, call them inside
`jax.shard_map` (the partitioner cannot see into a `pallas_call`).

Signatures (see each module for the details):

  write_kv(pool, kv [T, D], slots [T], layer=0) -> pool
  write_indexer_keys(pool, keys [T, d], slots [T], layer=0) -> pool
  decode(q [B, H, D], window_pool, window_block_table, seq_lens, sinks, compressed_pool=None,
         compressed_block_table=None, topk_indices=None, layer=0, compressed_layer=0, *, window, ratio=0)
         -> [B, H, D] float32
  prefill(q [B, S, H, D], window_pool, window_block_table, q_start, q_lens, sinks, compressed_pool=None,
          compressed_block_table=None, topk_indices=None, layer=0, compressed_layer=0, window_kv=None,
          *, window, ratio=0) -> [B, S, H, D] float32
  indexer_topk(q [B, S, h, d], weights [B, S, h], key_pool, block_table, q_start, q_lens, layer=0,
               *, topk, ratio) -> [B, S, topk] int32 (-1 = none)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_kernels import indexer_topk as _indexer
from pallas_kernels import kv_write as _kv_write
from pallas_kernels import sparse_decode as _decode
from pallas_kernels import sparse_prefill as _prefill
from pallas_kernels.paged_attention import pool_format

XLA = "xla"
PALLAS_FP8_DS_MLA = "pallas_fp8_ds_mla"
PALLAS_BF16 = "pallas_bf16"
BACKEND_NAMES = (XLA, PALLAS_FP8_DS_MLA, PALLAS_BF16)
_KV_FORMAT = {XLA: None, PALLAS_FP8_DS_MLA: "fp8_ds_mla", PALLAS_BF16: "bf16"}


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    kv_format: str | None  # the KV pool format the backend reads; None = any (fp8_ds_mla, bf16, float32)
    write_kv: Callable[..., Any]
    write_indexer_keys: Callable[..., Any]
    decode: Callable[..., Any]
    prefill: Callable[..., Any]
    indexer_topk: Callable[..., Any]


def as_planes(pool: Any) -> tuple | None:
    """A pool as a tuple of planes: tuples pass through, dataclasses give their fields in order."""
    if pool is None:
        return None
    if isinstance(pool, (tuple, list)):
        return tuple(pool)
    if dataclasses.is_dataclass(pool):
        return tuple(getattr(pool, f.name) for f in dataclasses.fields(pool))
    raise TypeError(f"a pool is a tuple of planes or a planes dataclass, got {type(pool).__name__}")


def _like(pool: Any, planes: tuple) -> Any:
    if isinstance(pool, (tuple, list)):
        return tuple(planes)
    names = [f.name for f in dataclasses.fields(pool)]
    return dataclasses.replace(pool, **dict(zip(names, planes)))


def _refuse_float32(kv_format: str | None, pool: Any, backend: str) -> None:
    """ValueError for a float32 pool (KV rows or indexer keys: one float32 plane) given to a
    Pallas backend (kv_format set): only the xla backend reads them."""
    planes = as_planes(pool)
    if kv_format is not None and planes is not None and len(planes) == 1 and planes[0].dtype == jnp.float32:
        reads = "bfloat16" if kv_format == "bf16" else kv_format  # as --kv-cache-dtype names it
        raise ValueError(
            f"attention backend {backend} cannot read float32 pools (the exact reference KV cache): use "
            f"--attention-backend xla, or --kv-cache-dtype {reads} for {backend}"
        )


def _require(kv_format: str | None, pool: Any, backend: str) -> None:
    _refuse_float32(kv_format, pool, backend)
    if kv_format is not None and pool is not None:
        got = pool_format(as_planes(pool))
        if got != kv_format:
            raise ValueError(f"attention backend {backend} reads {kv_format} KV pools, got a {got} pool")


def _make(name: str, *, device_kind: str | None, interpret: bool) -> AttentionBackend:
    kv_format = _KV_FORMAT[name]
    if name == XLA:
        write_kv_fn = write_idx_fn = _kv_write.write_kv_reference  # one reference writer, any pool
        decode_fn, prefill_fn = _decode.sparse_decode_reference, _prefill.sparse_prefill_reference
        topk_fn = _indexer.indexer_topk_reference
    else:
        launch = dict(device_kind=device_kind, interpret=interpret)
        write_kv_fn = functools.partial(_kv_write.write_kv, **launch)
        write_idx_fn = functools.partial(_kv_write.write_indexer_keys, **launch)
        decode_fn = functools.partial(_decode.sparse_decode, **launch)
        prefill_fn = functools.partial(_prefill.sparse_prefill, **launch)
        topk_fn = functools.partial(_indexer.indexer_topk, **launch)

    def write_kv(pool, kv, slots, layer=0):
        _require(kv_format, pool, name)
        return _like(pool, write_kv_fn(as_planes(pool), kv, slots, layer))

    def write_indexer_keys(pool, keys, slots, layer=0):
        _refuse_float32(kv_format, pool, name)
        return _like(pool, write_idx_fn(as_planes(pool), keys, slots, layer))

    def decode(
        q, window_pool, window_block_table, seq_lens, sinks, compressed_pool=None, compressed_block_table=None,
        topk_indices=None, layer=0, compressed_layer=0, *, window, ratio=0,
    ):
        _require(kv_format, window_pool, name)
        _require(kv_format, compressed_pool, name)
        return decode_fn(
            q, as_planes(window_pool), window_block_table, seq_lens, sinks, as_planes(compressed_pool),
            compressed_block_table, topk_indices, layer, compressed_layer, window=window, ratio=ratio,
        )

    def prefill(
        q, window_pool, window_block_table, q_start, q_lens, sinks, compressed_pool=None,
        compressed_block_table=None, topk_indices=None, layer=0, compressed_layer=0, window_kv=None, *,
        window, ratio=0,
    ):
        _require(kv_format, window_pool, name)
        _require(kv_format, compressed_pool, name)
        return prefill_fn(
            q, as_planes(window_pool), window_block_table, q_start, q_lens, sinks, as_planes(compressed_pool),
            compressed_block_table, topk_indices, layer, compressed_layer, window_kv, window=window, ratio=ratio,
        )

    def indexer(q, weights, key_pool, block_table, q_start, q_lens, layer=0, *, topk, ratio):
        _refuse_float32(kv_format, key_pool, name)
        return topk_fn(q, weights, as_planes(key_pool), block_table, q_start, q_lens, layer, topk=topk, ratio=ratio)

    return AttentionBackend(
        name=name, kv_format=kv_format, write_kv=write_kv, write_indexer_keys=write_indexer_keys,
        decode=decode, prefill=prefill, indexer_topk=indexer,
    )


def get_backend(
    name: str, *, device_kind: str | None = None, interpret: bool | None = None
) -> AttentionBackend:
    """The backend called `name` ("xla", "pallas_fp8_ds_mla", "pallas_bf16"). Pallas backends
    launch with the tuning table's entry for `device_kind` (default: the current device), or in
    the Pallas interpreter when `interpret` is true; None means "when JAX's default backend is
    the CPU" (there the Triton kernels cannot run)."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _make(key, device_kind=device_kind, interpret=interpret)
