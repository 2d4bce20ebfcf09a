"""The cache's allocators for one data-parallel rank: sequence slots and compressed blocks.

A slot owns a fixed sliding ring (the runner derives its block ids from the slot) and a
compressor-state row, so the slot allocator is also the sliding-block allocator. Compressed blocks
are `block_size` positions each (one id covers the CSA, HCA and indexer pools together); a
sequence that has written positions [0, n) holds exactly ceil(n / block_size) of them, in order.

Prefix caching: a full block can be registered under its chained hash (`prefix_cache.py`); then
any sequence whose prefix has that hash shares it (`share`), its reference count counting the
holders. A registered block whose count falls to zero stays cached, evictable: `allocate_blocks`
takes uncached free blocks first, then evicts cached ones, least recently released first (a
request releases its blocks last to first, so a prefix's tail goes before its head, whose blocks
more sequences share). Plain Python: no jax here.
"""

from __future__ import annotations

import collections
import math

from typing import Callable

from dsv4_jax.engine.request import Request


class BlockManager:
    """Free lists and reference counts of one rank's slots and compressed blocks."""

    def __init__(
        self,
        num_seq_slots: int,
        num_compressed_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
    ):
        for name, value in (
            ("num_seq_slots", num_seq_slots), ("num_compressed_blocks", num_compressed_blocks),
            ("block_size", block_size), ("max_blocks_per_seq", max_blocks_per_seq),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockManager {name} must be an int >= 1, got {value!r}")
        self.num_seq_slots = num_seq_slots
        self.num_compressed_blocks = num_compressed_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._free_slots = collections.deque(range(num_seq_slots))
        self._free_blocks = collections.deque(range(num_compressed_blocks))  # uncached, count 0
        self._ref_counts = [0] * num_compressed_blocks
        self._holders: dict[str, Request] = {}  # requests holding a slot or blocks, by id
        self._cached: dict[bytes, int] = {}  # block hash -> the block holding it
        self._hash_of: dict[int, bytes] = {}  # the reverse
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, count 0; LRU first
        self.on_evict: Callable[[bytes], None] | None = None  # told each hash evicted (its snapshot goes too)

    # ---- counters ---------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate_blocks` can hand out: uncached free ones and cached ones nobody holds."""
        return len(self._free_blocks) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the compressed blocks in use, 0..1 (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_compressed_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Compressed blocks that positions [0, num_tokens) occupy."""
        return math.ceil(num_tokens / self.block_size)

    # ---- allocation -------------------------------------------------------------------------
    def allocate_slot(self, request: Request) -> int:
        """Give `request` a free slot (the caller checks `num_free_slots` first)."""
        if request.slot is not None:
            raise ValueError(f"request {request.request_id} already holds slot {request.slot}")
        if not self._free_slots:
            raise RuntimeError(
                f"no free sequence slot for request {request.request_id} (all {self.num_seq_slots} held)"
            )
        request.slot = self._free_slots.popleft()
        self._holders[request.request_id] = request
        return request.slot

    def allocate_blocks(self, request: Request, up_to_tokens: int) -> bool:
        """Grow `request`'s blocks to cover positions [0, up_to_tokens). False, allocating
        nothing, when too few blocks are free; a sequence longer than the block table is a bug."""
        needed = self.blocks_for(up_to_tokens)
        if needed > self.max_blocks_per_seq:
            raise ValueError(
                f"request {request.request_id}: {up_to_tokens} tokens need {needed} compressed blocks of "
                f"{self.block_size}, more than max_blocks_per_seq={self.max_blocks_per_seq}"
            )
        missing = needed - len(request.compressed_blocks)
        if missing > self.num_free_blocks:
            return False
        for _ in range(max(missing, 0)):
            if self._free_blocks:
                block = self._free_blocks.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                block_hash = self._hash_of.pop(block)
                del self._cached[block_hash]
                if self.on_evict is not None:
                    self.on_evict(block_hash)
            self._ref_counts[block] += 1
            request.compressed_blocks.append(block)
        if missing > 0:
            self._holders[request.request_id] = request
        return True

    # ---- prefix caching -----------------------------------------------------------------------
    def num_cached_prefix(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a sequence with these block hashes are cached."""
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self._cached:
            n += 1
        return n

    def num_evictable_in(self, block_hashes: list[bytes]) -> int:
        """Of the cached blocks with these hashes, those nobody holds (sharing them takes them
        out of `num_free_blocks`)."""
        return sum(1 for h in block_hashes if self._cached[h] in self._evictable)

    def share(self, request: Request, block_hashes: list[bytes]) -> None:
        """Give `request`, holding no blocks yet, the cached blocks of these leading hashes."""
        if request.compressed_blocks:
            raise ValueError(f"request {request.request_id} already holds blocks: a prefix is shared first")
        for block_hash in block_hashes:
            block = self._cached[block_hash]
            self._evictable.pop(block, None)
            self._ref_counts[block] += 1
            request.compressed_blocks.append(block)
        if block_hashes:
            self._holders[request.request_id] = request

    def register(self, request: Request, block_hashes: list[bytes], first: int = 0) -> None:
        """Cache `request`'s full blocks first, first + 1, ... under these hashes (all computed).
        A hash cached already keeps its block; this request's copy stays its own."""
        for i, block_hash in enumerate(block_hashes, first):
            block = request.compressed_blocks[i]
            if block in self._hash_of or block_hash in self._cached:
                continue
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash: blocks nobody holds become plain free blocks, held ones stay
        their holders' (uncached)."""
        for block in self._evictable:
            self._free_blocks.append(block)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()

    def _release(self, block: int) -> None:
        """One reference to `block` dropped; with none left it is free, or evictable when cached."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free_blocks.append(block)

    def release_blocks_past(self, request: Request, num_tokens: int) -> None:
        """Release `request`'s blocks past those covering positions [0, num_tokens), last first:
        blocks a verify step took for drafts that were rejected (never cached: not full)."""
        keep = self.blocks_for(num_tokens)
        while len(request.compressed_blocks) > keep:
            self._release(request.compressed_blocks.pop())

    def free(self, request: Request) -> None:
        """Release everything `request` holds (its slot and its block references), its last
        block first (what is evicted first, once nobody holds it)."""
        for block in reversed(request.compressed_blocks):
            self._release(block)
        del request.compressed_blocks[:]
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None
        self._holders.pop(request.request_id, None)

    # ---- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every block is either free (count 0, listed once) or referenced exactly as often as
        holders list it; every slot is either free or held by exactly one request. Raises
        RuntimeError naming the first breach."""
        held = [0] * self.num_compressed_blocks
        for request in self._holders.values():
            for block in request.compressed_blocks:
                held[block] += 1
        free = [0] * self.num_compressed_blocks
        for block in [*self._free_blocks, *self._evictable]:
            free[block] += 1
        expected_free = [int(count == 0) for count in held]
        if any(block not in self._hash_of for block in self._evictable) or \
                any(block in self._hash_of for block in self._free_blocks):
            raise RuntimeError("an evictable block is not cached, or a plain free block is")
        if {self._cached[h]: h for h in self._cached} != self._hash_of:
            raise RuntimeError("the block-hash table and its reverse disagree")
        if held != self._ref_counts or free != expected_free:
            block = next(b for b, count in enumerate(held)
                         if (count, free[b]) != (self._ref_counts[b], expected_free[b]))
            raise RuntimeError(f"block {block}: reference count {self._ref_counts[block]}, listed by holders "
                               f"{held[block]} times, free {free[block]} times")
        slots = [r.slot for r in self._holders.values() if r.slot is not None]
        if sorted([*slots, *self._free_slots]) != list(range(self.num_seq_slots)):
            raise RuntimeError(f"slots held {sorted(slots)} and free {sorted(self._free_slots)} do not partition "
                               f"[0, {self.num_seq_slots})")
        for request in self._holders.values():
            if len(request.compressed_blocks) > self.max_blocks_per_seq:
                raise RuntimeError(f"request {request.request_id} holds {len(request.compressed_blocks)} blocks, "
                                   f"more than max_blocks_per_seq={self.max_blocks_per_seq}")
