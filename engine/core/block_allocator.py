"""One pool of KV cache blocks as plain ints: ref counts, a free list, and an optional prefix cache."""
from __future__ import annotations

import hashlib
import heapq
import itertools
from array import array
from collections import OrderedDict
from typing import Callable, NamedTuple, Optional

# A full block's key in the prefix cache: a digest of its parent's key and its own tokens.
BlockHash = bytes
NO_PREFIX_HASH: BlockHash = b""  # the chain's seed for a sequence's first block
HashFn = Callable[[bytes], bytes]


def sha256(data: bytes) -> bytes:
    """The default block hash (as vLLM's since CVE-2025-25183): collisions cannot be crafted."""
    return hashlib.sha256(data).digest()


def hash_block(prefix_hash: BlockHash, token_ids: tuple[int, ...], hash_fn: HashFn = sha256) -> BlockHash:
    """hash_fn(parent digest + token ids as int64): the parent's digest has a fixed length, so the
    encoding is unambiguous and equal digests mean an equal prefix unless hash_fn collides."""
    return hash_fn(prefix_hash + array("q", token_ids).tobytes())


class _CacheEntry(NamedTuple):
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    parent_id: int  # the entry id of the block before this one (0: the sequence's first block)
    entry_id: int  # unique per registration, never reused


class BlockAllocator:
    """Hands out physical block ids of one device (the KV cache or the host swap pool).

    With caching on, a full block whose K/V are computed is registered under its
    chained hash. When its ref count drops to 0 it is not wiped: it waits in an
    LRU evictor, still findable, until a fresh block is needed and nothing
    uncached is free.

    A lookup never trusts the hash alone: it hits only a block holding the same
    tokens whose parent is the very registration the caller matched one block
    before, so a hit means the whole prefix is equal token for token, whatever
    hash_fn is (a collision is a miss, never another prompt's K/V).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False, hash_fn: HashFn = sha256) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        # Read directly by the block manager's per-step checks (a method call per block costs too much there).
        self.ref_counts = [0] * num_blocks
        # Ref 0 and holding nothing worth keeping. A min-heap, lowest id first: the pools are torch.empty, whose
        # pages the OS commits on first write, so the resident part stays at the most blocks ever in use at
        # once (docs/reliability.md, "RSS grew under heavier load").
        self._free: list[int] = list(range(num_blocks))  # sorted, so already a heap
        self._evictor: OrderedDict[int, None] = OrderedDict()  # ref 0, cached; oldest first
        self._entry_of: dict[int, _CacheEntry] = {}  # cached block -> what it holds
        self._block_of: dict[BlockHash, int] = {}
        self._entry_ids = itertools.count(1)

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
            if block in self._entry_of:
                self._evictor[block] = None
            else:
                heapq.heappush(self._free, block)

    # -- prefix cache --------------------------------------------------------------

    def hash_block(self, prefix_hash: BlockHash, token_ids: tuple[int, ...]) -> BlockHash:
        return hash_block(prefix_hash, token_ids, self.hash_fn)

    def lookup(self, block_hash: BlockHash, parent: Optional[int], token_ids: tuple[int, ...]) -> Optional[int]:
        """The cached block holding exactly these tokens right after `parent` (the block this lookup's caller hit
        one position before; None for a first block), or None."""
        block = self._block_of.get(block_hash)
        if block is None:
            return None
        entry = self._entry_of[block]
        if entry.token_ids != token_ids or entry.parent_id != self._parent_id(parent):
            return None
        return block

    def take_cached(self, block: int) -> None:
        """Add a reference to a cached block found by lookup(); a free one leaves the evictor."""
        if self.ref_counts[block] == 0:
            del self._evictor[block]
        self.ref_counts[block] += 1

    def register(self, block: int, block_hash: BlockHash, parent: Optional[int], token_ids: tuple[int, ...]) -> None:
        """Make a computed full block findable; `parent` is the block before it in the sequence (None: first).

        The first block with given contents wins; duplicates, and blocks whose parent is not cached, stay private.
        """
        if not self.enable_caching or block_hash in self._block_of or block in self._entry_of:
            return
        if parent is not None and parent not in self._entry_of:
            return
        self._entry_of[block] = _CacheEntry(block_hash, token_ids, self._parent_id(parent), next(self._entry_ids))
        self._block_of[block_hash] = block

    def is_cached(self, block: int) -> bool:
        return block in self._entry_of

    def num_cached(self) -> int:
        return len(self._entry_of)

    def _parent_id(self, parent: Optional[int]) -> int:
        return 0 if parent is None else self._entry_of[parent].entry_id

    def _forget(self, block: int) -> None:
        # Blocks registered after this one keep its entry id, which no later registration reuses: they miss.
        del self._block_of[self._entry_of.pop(block).block_hash]
