"""Block tables of sequences over the device KV cache and the host swap pool; pure Python over ints.

The manager never touches tensors: it returns {src: dst} mappings and (src, dst)
copy-on-write pairs, and the cache engine moves the bytes.
"""
from __future__ import annotations

import enum
from typing import Optional

from engine.core.block_allocator import NO_PREFIX_HASH, BlockAllocator, BlockHash, HashFn, sha256
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

BlockTable = list[int]
# A table entry whose block was released because it lies wholly before the sliding window: a valid block id
# that no kernel reads (they start at the window), owned by nobody. Released entries are a table's prefix.
RELEASED_BLOCK = 0


class AllocStatus(enum.Enum):
    """Whether a group's blocks fit: now, after others finish, or never (even in an empty cache)."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


def watermark_blocks(num_device_blocks: int, watermark: float) -> int:
    """Device blocks admission keeps free; a prompt fits an empty cache only in num_device_blocks minus these."""
    return int(watermark * num_device_blocks)


def max_admissible_tokens(block_size: int, num_device_blocks: int, watermark: float) -> int:
    """The longest prompt can_allocate() ever admits (one sequence, empty cache); startup checks compare max_model_len."""
    return max(num_device_blocks - watermark_blocks(num_device_blocks, watermark), 0) * block_size


class BlockSpaceManager:
    """Maps each sequence's logical blocks to physical blocks, with ref counts, COW, swap and prefix caching."""

    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        sliding_window: Optional[int] = None,
        block_hash_fn: HashFn = sha256,
    ) -> None:
        self.block_size = block_size
        # Every layer attends within the last sliding_window tokens: blocks wholly before that are released.
        self.sliding_window = sliding_window
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks kept free at admission so running sequences can grow without preempting at once.
        self.watermark_blocks = watermark_blocks(num_device_blocks, watermark)
        self.gpu = BlockAllocator(num_device_blocks, enable_caching=enable_prefix_caching, hash_fn=block_hash_fn)
        self.cpu = BlockAllocator(num_cpu_blocks)
        self.block_tables: dict[int, BlockTable] = {}  # seq_id -> device blocks
        self.cpu_block_tables: dict[int, BlockTable] = {}  # seq_id -> swap blocks, while SWAPPED
        # seq_id -> chained hashes of its leading full, computed blocks (prefix caching only).
        self._seq_hashes: dict[int, list[BlockHash]] = {}
        # seq_id -> how many leading entries of its table (device or swap) are RELEASED_BLOCK; absent: none.
        self._num_released: dict[int, int] = {}
        self._num_queried_blocks = 0
        self._num_hit_blocks = 0
        # vLLM's prefix cache counters, in tokens: a new request's prompt looked up, and the tokens found cached
        # (a preempted request looking its blocks up again is not a new query).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission -----------------------------------------------------------------

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        seqs = group.get_seqs(SequenceStatus.WAITING)
        num_required = sum(self.blocks_for(seq.get_len()) for seq in seqs)
        num_taken_from_free = num_required
        if self._reads_prefix_cache(group):
            revived: set[int] = set()  # cached blocks that leave the evictor, counted once
            for seq in seqs:
                _, hit_blocks = self._find_cached_prefix(seq)
                num_taken_from_free -= len(hit_blocks)
                revived.update(b for b in hit_blocks if self.gpu.ref_count(b) == 0)
            num_taken_from_free += len(revived)
        if self.gpu.num_free() - num_taken_from_free >= self.watermark_blocks:
            return AllocStatus.OK
        # Never: it would not fit even in an empty cache, where nothing is cached to share.
        if self.num_device_blocks - num_required < self.watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        """Blocks for all get_len() tokens of each WAITING sequence; prefix-cache hits set num_computed_tokens."""
        seqs = group.get_seqs(SequenceStatus.WAITING)
        # Take every cache hit before allocating fresh blocks, which could evict a block a sibling would hit.
        for seq in seqs:
            assert seq.seq_id not in self.block_tables, f"{seq} already has blocks"
            hashes: list[BlockHash] = []
            table: BlockTable = []
            if self._reads_prefix_cache(group):
                hashes, table = self._find_cached_prefix(seq)
                for block in table:
                    self.gpu.take_cached(block)
                self._num_queried_blocks += (seq.get_len() - 1) // self.block_size
                self._num_hit_blocks += len(table)
                if not seq.output_token_ids:
                    self.prefix_cache_queries += seq.get_len()
                    self.prefix_cache_hits += len(table) * self.block_size
            self.block_tables[seq.seq_id] = table
            self._seq_hashes[seq.seq_id] = hashes
            seq.num_computed_tokens = len(hashes) * self.block_size
        for seq in seqs:
            table = self.block_tables[seq.seq_id]
            table.extend(self.gpu.allocate() for _ in range(self.blocks_for(seq.get_len()) - len(table)))

    def _reads_prefix_cache(self, group: SequenceGroup) -> bool:
        # Prompt logprobs need the logits of every prompt token, so such a prompt is computed in full.
        return self.enable_prefix_caching and not group.wants_prompt_logprobs

    def _find_cached_prefix(self, seq: Sequence) -> tuple[list[BlockHash], list[int]]:
        """Hashes and blocks of the longest cached run of leading full blocks.

        The block holding the last token is never reused: at least one token must
        be computed to get logits, and its K/V must go to a block nobody shares.
        """
        token_ids = seq.all_token_ids
        size = self.block_size
        hashes: list[BlockHash] = []
        blocks: list[int] = []
        prefix_hash = NO_PREFIX_HASH
        for i in range((len(token_ids) - 1) // size):
            chunk = tuple(token_ids[i * size:(i + 1) * size])
            prefix_hash = self.gpu.hash_block(prefix_hash, chunk)
            block = self.gpu.lookup(prefix_hash, blocks[-1] if blocks else None, chunk)
            if block is None:
                break
            hashes.append(prefix_hash)
            blocks.append(block)
        return hashes, blocks

    # -- decoding ------------------------------------------------------------------

    # The decode step calls these two for every running sequence: they read the tables and ref counts directly.

    def num_append_blocks(self, seqs: list[Sequence]) -> int:
        """Fresh blocks the next append_slots() of these sequences takes: growth plus copy-on-write."""
        size = self.block_size
        refs = self.gpu.ref_counts
        num_required = 0
        for seq in seqs:
            table = self.block_tables[seq.seq_id]
            num_blocks = len(table)
            grow = (seq.get_len() + size - 1) // size - num_blocks
            if grow > 0:  # never negative: the scheduler reads 0 as "nothing to append"
                num_required += grow
            # The next forward writes from token num_computed_tokens on; a shared block there must be copied first.
            first_written = seq.num_computed_tokens // size
            if first_written < num_blocks and refs[table[first_written]] > 1:
                num_required += 1
        return num_required

    def can_append_slots(self, group: SequenceGroup) -> bool:
        return self.num_append_blocks(group.get_seqs(SequenceStatus.RUNNING)) <= self.gpu.num_free()

    def append_slots(self, seq: Sequence) -> Optional[tuple[int, int]]:
        """Grow the table to cover get_len() tokens; returns the (src, dst) copy when the written block was shared.

        Under a sliding window, first release the blocks no query of this step or later reads."""
        table = self.block_tables[seq.seq_id]
        size = self.block_size
        if self.sliding_window is not None:
            self._release_outside_window(seq, table, self.gpu)
        cow = None
        index = seq.num_computed_tokens // size
        if index < len(table) and self.gpu.ref_counts[table[index]] > 1:
            src, dst = table[index], self.gpu.allocate()
            self.gpu.free(src)  # still held by the siblings that share it
            table[index] = dst
            cow = (src, dst)
        for _ in range((seq.get_len() + size - 1) // size - len(table)):
            table.append(self.gpu.allocate())
        return cow

    def grow_for_draft(self, seq: Sequence, num_tokens: int) -> bool:
        """Speculative decoding: cover `num_tokens` (> get_len(): the proposed tokens too) with fresh blocks, if
        that many are free; False (nothing taken) otherwise. append_slots ran first: the written block is unshared."""
        table = self.block_tables[seq.seq_id]
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.gpu.num_free():
            return False
        table.extend(self.gpu.allocate() for _ in range(need))
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the whole blocks past the first `num_tokens` tokens (rejected proposals' slots); tail first."""
        table = self.block_tables[seq.seq_id]
        keep = max(self.blocks_for(num_tokens), self._num_released.get(seq.seq_id, 0))
        while len(table) > keep:
            self.gpu.free(table.pop())

    def _release_outside_window(self, seq: Sequence, table: BlockTable, allocator: BlockAllocator) -> None:
        # The next forward's first query is token num_computed_tokens: it, and every later one, sees only
        # tokens from num_computed_tokens - sliding_window + 1 on. Blocks wholly before that go back.
        first_seen = max(seq.num_computed_tokens - self.sliding_window + 1, 0)
        released = self._num_released.get(seq.seq_id, 0)
        keep_from = min(first_seen // self.block_size, len(table))
        if keep_from <= released:
            return
        for i in range(released, keep_from):
            allocator.free(table[i])
            table[i] = RELEASED_BLOCK
        self._num_released[seq.seq_id] = keep_from

    def num_released(self, seq_id: int) -> int:
        """Leading entries of the sequence's table (device or swap) released out of the sliding window."""
        return self._num_released.get(seq_id, 0)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; the first write to a shared block copies it."""
        table = self.block_tables[parent.seq_id]
        released = self._num_released.get(parent.seq_id, 0)
        for block in table[released:]:
            self.gpu.incref(block)
        self.block_tables[child.seq_id] = list(table)
        if released:
            self._num_released[child.seq_id] = released
        self._seq_hashes[child.seq_id] = list(self._seq_hashes.get(parent.seq_id, ()))

    def free(self, seq: Sequence) -> None:
        """Return every block of the sequence, wherever it lives. Freeing twice is harmless."""
        self._seq_hashes.pop(seq.seq_id, None)
        released = self._num_released.pop(seq.seq_id, 0)
        for tables, allocator in ((self.block_tables, self.gpu), (self.cpu_block_tables, self.cpu)):
            table = tables.pop(seq.seq_id, None)
            # Tail first: the evictor then drops a chain's tail before its head, which more prompts share.
            for block in reversed((table or [])[released:]):
                allocator.free(block)

    def get_block_table(self, seq: Sequence) -> BlockTable:
        return self.block_tables[seq.seq_id]

    # -- swapping ------------------------------------------------------------------

    def _unique_blocks(self, tables: dict[int, BlockTable], seqs: list[Sequence]) -> int:
        return len({block for seq in seqs for block in tables[seq.seq_id][self._num_released.get(seq.seq_id, 0):]})

    def can_swap_out(self, group: SequenceGroup) -> bool:
        running = group.get_seqs(SequenceStatus.RUNNING)
        return self._unique_blocks(self.block_tables, running) <= self.cpu.num_free()

    def swap_out(self, group: SequenceGroup, mapping: Optional[dict[int, int]] = None) -> dict[int, int]:
        """Move the RUNNING sequences' blocks to the swap pool; returns {device_block: cpu_block}.

        Pass the step's mapping so far: a block another group swapped out in this step (a shared
        prefix-cache block) then maps to the same cpu block, which a {src: dst} dict can express.
        """
        mapping = self._move(group.get_seqs(SequenceStatus.RUNNING), self.block_tables, self.gpu,
                             self.cpu_block_tables, self.cpu, mapping)
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            # The device blocks change on the way back; mark_blocks_as_computed re-registers them then.
            self._seq_hashes[seq.seq_id] = []
        return mapping

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        swapped = group.get_seqs(SequenceStatus.SWAPPED)
        # One extra block per sequence: each appends a slot (or copies a shared block) right after.
        num_required = self._unique_blocks(self.cpu_block_tables, swapped) + len(swapped)
        if self.num_device_blocks - num_required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu.num_free() - num_required < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def swap_in(self, group: SequenceGroup, mapping: Optional[dict[int, int]] = None) -> dict[int, int]:
        """Bring the SWAPPED sequences' blocks back to the device; returns {cpu_block: device_block} (see swap_out).

        Under a sliding window, blocks the window has left behind are released on the host first: released
        after the move, a device block in the step's mapping could be freed (and reused) while a later group
        of the same step, sharing its host block, still maps to it."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        if self.sliding_window is not None:
            for seq in seqs:
                self._release_outside_window(seq, self.cpu_block_tables[seq.seq_id], self.cpu)
        return self._move(seqs, self.cpu_block_tables, self.cpu, self.block_tables, self.gpu, mapping)

    def _move(self, seqs: list[Sequence], src_tables: dict[int, BlockTable], src: BlockAllocator,
              dst_tables: dict[int, BlockTable], dst: BlockAllocator,
              mapping: Optional[dict[int, int]] = None) -> dict[int, int]:
        # A block shared by siblings (or, within one step, by groups) moves once and stays shared on the other side.
        # Within one step a source block id keeps its contents: blocks freed here are only reused by groups
        # that are not moved again in the same step.
        if mapping is None:
            mapping = {}
        for seq in seqs:
            table = src_tables.pop(seq.seq_id)
            released = self._num_released.get(seq.seq_id, 0)
            new_table = table[:released]  # released entries stay released on the other side
            for block in table[released:]:
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                new_table.append(mapping[block])
                src.free(block)
            dst_tables[seq.seq_id] = new_table
        return mapping

    # -- prefix cache --------------------------------------------------------------

    def mark_blocks_as_computed(self, group: SequenceGroup) -> None:
        """After a forward: full blocks whose K/V are now computed become findable by later prompts."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            hashes = self._seq_hashes[seq.seq_id]
            num_full = seq.num_computed_tokens // size
            if len(hashes) >= num_full:
                continue  # the common decode step: no block filled up
            token_ids = seq.all_token_ids
            table = self.block_tables[seq.seq_id]
            released = self._num_released.get(seq.seq_id, 0)
            prefix_hash = hashes[-1] if hashes else NO_PREFIX_HASH
            for i in range(len(hashes), num_full):
                chunk = tuple(token_ids[i * size:(i + 1) * size])
                prefix_hash = self.gpu.hash_block(prefix_hash, chunk)
                hashes.append(prefix_hash)
                # A block registers under its parent's identity: the first one, and one whose parent is held.
                if i == 0 and not released:
                    self.gpu.register(table[i], prefix_hash, None, chunk)
                elif i > released:
                    self.gpu.register(table[i], prefix_hash, table[i - 1], chunk)

    # -- figures -------------------------------------------------------------------

    def get_num_free_device_blocks(self) -> int:
        return self.gpu.num_free()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free()

    def device_usage(self) -> float:
        return 1.0 - self.gpu.num_free() / self.num_device_blocks if self.num_device_blocks else 0.0

    def cpu_usage(self) -> float:
        return 1.0 - self.cpu.num_free() / self.num_cpu_blocks if self.num_cpu_blocks else 0.0

    def prefix_cache_hit_rate(self) -> float:
        """Fraction of the full prompt blocks looked up at admission that were found in the cache."""
        return self._num_hit_blocks / self._num_queried_blocks if self._num_queried_blocks else 0.0
