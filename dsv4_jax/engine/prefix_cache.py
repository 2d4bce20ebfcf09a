"""The prefix cache's host side: chained block hashes, and the pool of state snapshots a hit restores.

A full block of `block_size` tokens is named by a chained hash: the hash of its parent block's
hash and its own token ids, the first block's parent being a root that names what changes the KV
(model, dtypes). Equal hashes mean equal token prefixes, so a block's compressed entries (which
never change once the block is full) can be shared by every sequence with that prefix
(`BlockManager` keeps the table).

A hit needs more than blocks: the sliding-window rows before the boundary and the CSA / indexer
compressor rows belong to a sequence slot, not to blocks. They are copied at block boundaries
into a snapshot (`ModelRunner.take_snapshots`), one per boundary, named by the hash of the block
that ends there; `SnapshotPool` hands out snapshot ids and evicts the least recently used.
Plain Python: no jax here.
"""

from __future__ import annotations

import array
import collections
import hashlib
from typing import Callable, Sequence

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

BlockHash = bytes
HashFunction = Callable[[BlockHash, Sequence[int]], BlockHash]


def block_hasher(algo: str) -> HashFunction:
    """`hash(parent, token_ids)` of `--prefix-caching-hash-algo` (vLLM's names): sha256 over the
    parent and the ids as int32 bytes; the `_cbor` variants over their canonical CBOR encoding
    (reproducible by any language); xxhash's 128-bit xxh3 when the `xxhash` package is installed.
    ValueError naming the flag for an unknown or unavailable one."""
    if algo not in HASH_ALGOS:
        raise ValueError(f"prefix_caching_hash_algo (--prefix-caching-hash-algo) must be one of "
                         f"{', '.join(HASH_ALGOS)}; got {algo!r}")
    if algo.startswith("xxhash"):
        try:
            import xxhash
        except ImportError:
            raise ValueError(f"--prefix-caching-hash-algo {algo} needs the xxhash package (pip install xxhash); "
                             "sha256 (the default) needs nothing") from None
        digest = xxhash.xxh3_128_digest
    else:
        def digest(data: bytes) -> bytes:
            return hashlib.sha256(data).digest()
    if algo.endswith("_cbor"):
        import cbor2

        return lambda parent, ids: digest(cbor2.dumps([parent, [int(t) for t in ids]], canonical=True))
    return lambda parent, ids: digest(parent + array.array("i", ids).tobytes())


def root_hash(hash_fn: HashFunction, identity: str) -> BlockHash:
    """The parent of every sequence's first block: the hash of what changes the KV besides the
    tokens (the model and its dtypes), so two engines never take each other's blocks for equal."""
    return hash_fn(hashlib.sha256(identity.encode()).digest(), ())


class SnapshotPool:
    """Snapshot ids of one data-parallel rank: free, reserved for a snapshot a step takes (its
    block's hash is known once the step is applied), or holding the state at the end of a cached
    block, least recently used first. A registered snapshot may be evicted at any time: a hit
    copies it out in the device's order before any later snapshot overwrites it."""

    def __init__(self, num_snapshots: int):
        self.num_snapshots = num_snapshots
        self._free = collections.deque(range(num_snapshots))
        self._reserved: set[int] = set()
        self._by_hash: dict[BlockHash, int] = {}
        self._lru: collections.OrderedDict[int, BlockHash] = collections.OrderedDict()  # id -> hash, oldest first

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._by_hash

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def reserve(self) -> int | None:
        """An id for a snapshot about to be taken: a free one, else the least recently used one's
        (evicted); None when every id is reserved."""
        if self._free:
            snap = self._free.popleft()
        elif self._lru:
            snap, old = self._lru.popitem(last=False)
            del self._by_hash[old]
        else:
            return None
        self._reserved.add(snap)
        return snap

    def register(self, snap: int, block_hash: BlockHash) -> None:
        """A reserved snapshot now holds the state at the end of the block `block_hash`; if that
        block has one already, this one goes back to the free ids."""
        self._reserved.remove(snap)
        if block_hash in self._by_hash:
            self._free.append(snap)
            return
        self._by_hash[block_hash] = snap
        self._lru[snap] = block_hash

    def release(self, snap: int) -> None:
        """A reserved snapshot that will not be registered (its request ended, or its block was not cached)."""
        self._reserved.remove(snap)
        self._free.append(snap)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The snapshot at the end of `block_hash` (now the most recently used), or None."""
        snap = self._by_hash.get(block_hash)
        if snap is not None:
            self._lru.move_to_end(snap)
        return snap

    def drop(self, block_hash: BlockHash) -> None:
        """Forget the snapshot of a block evicted from the cache (no hit can reach it any more)."""
        snap = self._by_hash.pop(block_hash, None)
        if snap is not None:
            del self._lru[snap]
            self._free.append(snap)

    def clear(self) -> None:
        """Every registered snapshot freed (reserved ones stay reserved)."""
        self._free.extend(self._lru)
        self._lru.clear()
        self._by_hash.clear()

    def check_invariants(self) -> None:
        """Every id is exactly one of free, reserved or registered. RuntimeError naming the breach."""
        ids = [*self._free, *self._reserved, *self._lru]
        if sorted(ids) != list(range(self.num_snapshots)):
            raise RuntimeError(f"snapshot ids free {sorted(self._free)}, reserved {sorted(self._reserved)} and "
                               f"cached {sorted(self._lru)} do not partition [0, {self.num_snapshots})")
        if {self._by_hash[h] for h in self._lru.values()} != set(self._lru) or len(self._by_hash) != len(self._lru):
            raise RuntimeError("the snapshot table and its LRU list disagree")

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)
