"""One pool of KV cache blocks as plain ints: ref counts, a free list, and an optional prefix cache."""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Optional

# The hash of a full block: its tokens chained with the hash of everything before it.
BlockHash = int
NO_PREFIX_HASH: BlockHash = 0  # the chain's seed for a sequence's first block


def hash_block(prefix_hash: BlockHash, token_ids: tuple[int, ...]) -> BlockHash:
    """Chained hash: equal hashes mean an equal prefix, so one lookup per block suffices."""
    return hash((prefix_hash, token_ids))


class BlockAllocator:
    """Hands out physical block ids of one device (the KV cache or the host swap pool).

    With caching on, a full block whose K/V are computed is registered under its
    chained hash. When its ref count drops to 0 it is not wiped: it waits in an
    LRU evictor, still findable, until a fresh block is needed and nothing
    uncached is free.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Read directly by the block manager's per-step checks (a method call per block costs too much there).
        self.ref_counts = [0] * num_blocks
        # Ref 0 and holding nothing worth keeping; a min-heap: the lowest free id is handed out first. The pools
        # are torch.empty, whose pages the OS commits on first write: lowest-first keeps the written part (the
        # RSS) at the most blocks ever in use at once, and a prompt's blocks in ascending order. A queue cycled
        # through the whole pool: with the default 4 GiB pools the RSS grew 760 MiB/min (docs/reliability.md).
        self._free: list[int] = list(range(num_blocks))  # sorted, so already a heap
        self._evictor: OrderedDict[int, None] = OrderedDict()  # ref 0, cached; oldest first
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        # The tokens of each cached block: a lookup compares them, so a hash collision is a miss, not wrong K/V.
        self._tokens_of: dict[int, tuple[int, ...]] = {}

    def num_free(self) -> int:
        return len(self._free) + len(self._evictor)

    def ref_count(self, block: int) -> int:
        return self.ref_counts[block]

    def allocate(self) -> int:
        """A block with ref count 1 and no cached identity; evicts the LRU cached block if needed."""
        if self._free:
            block = heapq.heappop(self._free)
        elif self._evictor:
            block, _ = self._evictor.popitem(last=False)
            self._forget(block)
        else:
            raise RuntimeError("Out of KV cache blocks: the caller must check can_allocate / can_append_slots first.")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} is free; use take_cached() for cached blocks"
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; at zero the block becomes free (kept findable if it is cached)."""
        count = self.ref_counts[block]
        assert count > 0, f"double free of block {block}"
        self.ref_counts[block] = count - 1
        if count == 1:
            if block in self._hash_of:
                self._evictor[block] = None
            else:
                heapq.heappush(self._free, block)

    # -- prefix cache --------------------------------------------------------------

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> Optional[int]:
        """The cached block holding exactly these tokens after this prefix, or None."""
        block = self._block_of.get(block_hash)
        if block is None or self._tokens_of[block] != token_ids:
            return None
        return block

    def take_cached(self, block: int) -> None:
        """Add a reference to a cached block found by lookup(); a free one leaves the evictor."""
        if self.ref_counts[block] == 0:
            del self._evictor[block]
        self.ref_counts[block] += 1

    def register(self, block: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Make a computed full block findable. The first block with given contents wins; duplicates stay private."""
        if not self.enable_caching or block_hash in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        self._tokens_of[block] = token_ids

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def num_cached(self) -> int:
        return len(self._hash_of)

    def _forget(self, block: int) -> None:
        del self._block_of[self._hash_of.pop(block)]
        del self._tokens_of[block]
