"""Block manager: exact free-block counts, copy-on-write, swap, prefix cache (hash chain, reuse, LRU eviction),
sliding-window release."""
from collections import Counter

import pytest

from engine.core.block_manager import RELEASED_BLOCK, AllocStatus, BlockSpaceManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4


def make_group(request_id: str, prompt: list[int], seq_id: int, best_of: int = 1) -> SequenceGroup:
    params = SamplingParams(n=1, best_of=best_of, temperature=1.0)
    return SequenceGroup(request_id, [Sequence(seq_id, list(prompt))], params)


def run(group: SequenceGroup) -> None:
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING


def computed(bm: BlockSpaceManager, group: SequenceGroup) -> None:
    """What the scheduler does after a forward."""
    for seq in group.get_seqs(SequenceStatus.RUNNING):
        seq.num_computed_tokens = seq.get_len()
    bm.mark_blocks_as_computed(group)


def assert_ref_counts_match_tables(bm: BlockSpaceManager) -> None:
    for tables, alloc in ((bm.block_tables, bm.gpu), (bm.cpu_block_tables, bm.cpu)):
        uses = Counter(b for seq_id, table in tables.items() for b in table[bm.num_released(seq_id):])
        for block in range(alloc.num_blocks):
            assert alloc.ref_count(block) == uses[block], f"block {block}"
        assert alloc.num_free() == alloc.num_blocks - len(uses)


def test_allocate_counts_blocks_and_free_returns_them():
    bm = BlockSpaceManager(BS, num_device_blocks=10, num_cpu_blocks=4, watermark=0.0)
    group = make_group("a", list(range(9)), seq_id=0)  # 9 tokens -> 3 blocks
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    assert len(bm.get_block_table(group.seqs[0])) == 3
    assert bm.get_num_free_device_blocks() == 7
    assert bm.device_usage() == pytest.approx(0.3)
    bm.free(group.seqs[0])
    bm.free(group.seqs[0])  # twice is harmless
    assert bm.get_num_free_device_blocks() == 10
    assert_ref_counts_match_tables(bm)


def test_can_allocate_watermark_later_and_never():
    bm = BlockSpaceManager(BS, num_device_blocks=10, num_cpu_blocks=0, watermark=0.2)  # keeps 2 blocks free
    assert bm.can_allocate(make_group("big", list(range(33)), 0)) is AllocStatus.NEVER  # 9 > 10 - 2
    assert bm.can_allocate(make_group("fits", list(range(32)), 1)) is AllocStatus.OK  # 8 == 10 - 2
    first = make_group("first", list(range(20)), 2)  # 5 blocks
    bm.allocate(first)
    assert bm.can_allocate(make_group("four", list(range(13)), 3)) is AllocStatus.LATER  # 5 - 4 < 2
    assert bm.can_allocate(make_group("three", list(range(12)), 4)) is AllocStatus.OK  # 5 - 3 == 2


def test_allocate_with_watermark_exact_free_counts():
    bm = BlockSpaceManager(BS, num_device_blocks=10, num_cpu_blocks=0, watermark=0.2)
    assert bm.watermark_blocks == 2
    a = make_group("a", list(range(16)), 0)  # 4 blocks
    b = make_group("b", list(range(16)), 1)  # 4 more would leave 2 == watermark: still OK
    c = make_group("c", [1], 2)  # 1 more would leave 1 < 2
    for group, free_after in ((a, 6), (b, 2)):
        assert bm.can_allocate(group) is AllocStatus.OK
        bm.allocate(group)
        assert bm.get_num_free_device_blocks() == free_after
    assert bm.can_allocate(c) is AllocStatus.LATER
    bm.free(a.seqs[0])
    assert bm.get_num_free_device_blocks() == 6 and bm.can_allocate(c) is AllocStatus.OK
    assert_ref_counts_match_tables(bm)


def test_append_slots_grows_one_block_at_the_boundary():
    bm = BlockSpaceManager(BS, 10, 0, watermark=0.0)
    group = make_group("a", [1, 2, 3, 4], 0)
    bm.allocate(group)
    run(group)
    seq = group.seqs[0]
    computed(bm, group)
    seq.append_token(5, {5: 0.0})
    assert bm.can_append_slots(group)
    assert bm.append_slots(seq) is None
    assert len(bm.get_block_table(seq)) == 2
    assert bm.get_num_free_device_blocks() == 8
    computed(bm, group)
    seq.append_token(6, {6: 0.0})
    assert bm.append_slots(seq) is None  # room left in block 2
    assert bm.get_num_free_device_blocks() == 8


def test_fork_then_append_costs_exactly_one_block_with_a_copy():
    bm = BlockSpaceManager(BS, 10, 0, watermark=0.0)
    group = make_group("a", [1, 2, 3, 4, 5, 6], 0, best_of=2)  # 2 blocks, the last half full
    bm.allocate(group)
    run(group)
    computed(bm, group)
    parent = group.seqs[0]
    child = parent.fork(1)
    group.add(child)
    bm.fork(parent, child)
    assert bm.get_num_free_device_blocks() == 8  # sharing costs nothing
    parent.append_token(7, {7: 0.0})
    child.append_token(8, {8: 0.0})
    shared_last = bm.get_block_table(parent)[-1]
    cow = bm.append_slots(parent)
    assert cow is not None and cow[0] == shared_last and cow[1] != shared_last
    assert bm.append_slots(child) is None  # the sibling now owns the old block alone
    assert bm.get_num_free_device_blocks() == 7
    assert bm.get_block_table(parent)[0] == bm.get_block_table(child)[0]  # the full first block stays shared
    assert bm.get_block_table(parent)[-1] == cow[1] and bm.get_block_table(child)[-1] == shared_last
    assert_ref_counts_match_tables(bm)
    for seq in group.seqs:
        bm.free(seq)
    assert bm.get_num_free_device_blocks() == 10


def test_swap_out_and_in_move_free_counts_by_the_table_length():
    bm = BlockSpaceManager(BS, 10, 6, watermark=0.0)
    group = make_group("a", list(range(10)), 0, best_of=2)  # 3 blocks
    bm.allocate(group)
    run(group)
    computed(bm, group)
    child = group.seqs[0].fork(1)
    group.add(child)
    bm.fork(group.seqs[0], child)
    assert bm.can_swap_out(group)
    out_map = bm.swap_out(group)
    assert len(out_map) == 3  # shared blocks move once
    assert bm.get_num_free_device_blocks() == 10 and bm.get_num_free_cpu_blocks() == 3
    assert bm.cpu_usage() == pytest.approx(0.5)
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    assert_ref_counts_match_tables(bm)  # both siblings hold each cpu block: ref count 2
    assert bm.can_swap_in(group) is AllocStatus.OK
    in_map = bm.swap_in(group)
    assert sorted(in_map) == sorted(out_map.values())
    assert bm.get_num_free_device_blocks() == 7 and bm.get_num_free_cpu_blocks() == 6
    assert bm.get_block_table(group.seqs[0]) == bm.get_block_table(child)
    assert_ref_counts_match_tables(bm)


def test_swap_churn_reuses_the_same_host_blocks():
    # The pools are torch.empty: a block's pages count in the RSS once written. A free queue cycled through
    # the whole pool, and the server's RSS grew until all of it was resident (docs/reliability.md).
    bm = BlockSpaceManager(BS, 10, 100, watermark=0.0)
    group = make_group("a", list(range(10)), 0)  # 3 blocks
    bm.allocate(group)
    run(group)
    host_blocks, device_blocks = set(), set()
    for _ in range(20):
        host_blocks |= set(bm.swap_out(group).values())
        group.seqs[0].status = SequenceStatus.SWAPPED
        device_blocks |= set(bm.swap_in(group).values())
        run(group)
    assert host_blocks == {0, 1, 2} and device_blocks == {0, 1, 2}
    assert_ref_counts_match_tables(bm)


def test_swap_limits():
    bm = BlockSpaceManager(BS, 4, 2, watermark=0.0)
    group = make_group("a", list(range(12)), 0)  # 3 blocks
    bm.allocate(group)
    run(group)
    assert not bm.can_swap_out(group)  # 3 blocks, 2 in the swap pool
    bm2 = BlockSpaceManager(BS, 4, 8, watermark=0.0)
    group = make_group("b", list(range(16)), 0)  # the whole cache
    bm2.allocate(group)
    run(group)
    bm2.swap_out(group)
    group.seqs[0].status = SequenceStatus.SWAPPED
    assert bm2.can_swap_in(group) is AllocStatus.NEVER  # 4 blocks + 1 to append > 4


def prefix_manager(num_device_blocks: int = 8) -> BlockSpaceManager:
    return BlockSpaceManager(BS, num_device_blocks, 0, watermark=0.0, enable_prefix_caching=True)


def test_prefix_cache_reuses_computed_full_blocks_only():
    bm = prefix_manager()
    prompt = list(range(10))  # blocks [0..3] [4..7] [8, 9]
    a = make_group("a", prompt, 0)
    b = make_group("b", prompt, 1)
    bm.allocate(a)
    bm.allocate(b)  # a has not run yet: nothing to reuse
    assert b.seqs[0].num_computed_tokens == 0
    bm.free(b.seqs[0])
    run(a)
    computed(bm, a)
    c = make_group("c", prompt + [99], 2)
    bm.allocate(c)
    seq_a, seq_c = a.seqs[0], c.seqs[0]
    assert seq_c.num_computed_tokens == 8
    assert bm.get_block_table(seq_c)[:2] == bm.get_block_table(seq_a)[:2]
    assert bm.get_block_table(seq_c)[2] != bm.get_block_table(seq_a)[2]  # the partial block is never shared
    assert bm.prefix_cache_hit_rate() == pytest.approx(2 / 6)  # a: 0 of 2, b: 0 of 2, c: 2 of 2
    assert_ref_counts_match_tables(bm)


def test_prefix_cache_chain_needs_the_same_prefix():
    bm = prefix_manager()
    a = make_group("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 0)
    bm.allocate(a)
    run(a)
    computed(bm, a)
    b = make_group("b", [0, 2, 3, 4, 5, 6, 7, 8, 9], 1)  # same second block, different first
    assert bm.can_allocate(b) is AllocStatus.OK
    bm.allocate(b)
    assert b.seqs[0].num_computed_tokens == 0
    assert set(bm.get_block_table(b.seqs[0])).isdisjoint(bm.get_block_table(a.seqs[0]))


def test_prefix_cache_leaves_one_token_to_compute():
    bm = prefix_manager()
    prompt = list(range(8))  # exactly two full blocks
    a = make_group("a", prompt, 0)
    bm.allocate(a)
    run(a)
    computed(bm, a)
    b = make_group("b", prompt, 1)
    bm.allocate(b)
    seq_b = b.seqs[0]
    assert seq_b.num_computed_tokens == 4  # the block of the last token is computed again, privately
    assert bm.get_block_table(seq_b)[0] == bm.get_block_table(a.seqs[0])[0]
    assert bm.get_block_table(seq_b)[1] != bm.get_block_table(a.seqs[0])[1]


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = prefix_manager(num_device_blocks=4)
    old = make_group("old", [1, 1, 1, 1, 9], 0)  # 2 blocks: [1111] cached + partial
    new = make_group("new", [2, 2, 2, 2, 9], 1)
    for group in (old, new):
        bm.allocate(group)
        run(group)
        computed(bm, group)
        bm.free(group.seqs[0])
    assert bm.get_num_free_device_blocks() == 4  # cached blocks count as free
    assert bm.gpu.num_cached() == 2
    # Reviving a cached block takes it out of the evictor: it is no longer free.
    again = make_group("again", [2, 2, 2, 2, 7], 2)
    assert bm.can_allocate(again) is AllocStatus.OK
    bm.allocate(again)
    assert again.seqs[0].num_computed_tokens == 4
    assert bm.get_num_free_device_blocks() == 2
    # Two fresh blocks: the uncached free block goes first, then the least recently freed cached one ([1111]).
    fresh = make_group("fresh", [5, 6, 7, 8, 9], 3)
    bm.allocate(fresh)
    assert bm.get_num_free_device_blocks() == 0
    assert bm.gpu.num_cached() == 1
    probe = make_group("probe", [1, 1, 1, 1, 9], 4)
    assert bm.can_allocate(probe) is AllocStatus.LATER
    bm.free(again.seqs[0])
    bm.allocate(probe)
    assert probe.seqs[0].num_computed_tokens == 0  # [1111] was evicted
    assert_ref_counts_match_tables(bm)


def test_can_allocate_counts_revived_blocks_once():
    bm = prefix_manager(num_device_blocks=3)
    a = make_group("a", [1, 2, 3, 4, 5], 0)
    bm.allocate(a)
    run(a)
    computed(bm, a)
    bm.free(a.seqs[0])
    # Recomputing a two-sequence group: both hit the cached first block; 1 revived + 2 private blocks = 3.
    seqs = [Sequence(10, [1, 2, 3, 4, 5]), Sequence(11, [1, 2, 3, 4, 5])]
    seqs[0].output_token_ids, seqs[1].output_token_ids = [6], [7]
    group = SequenceGroup("g", seqs, SamplingParams(n=2, temperature=1.0))
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    assert bm.get_num_free_device_blocks() == 0
    assert bm.get_block_table(seqs[0])[0] == bm.get_block_table(seqs[1])[0]
    assert_ref_counts_match_tables(bm)


def test_prompt_logprobs_requests_compute_the_whole_prompt():
    bm = prefix_manager()
    a = make_group("a", list(range(10)), 0)
    bm.allocate(a)
    run(a)
    computed(bm, a)
    b = make_group("b", list(range(10)), 1)
    b.sampling_params.prompt_logprobs = 1
    assert bm.can_allocate(b) is AllocStatus.OK
    bm.allocate(b)
    assert b.seqs[0].num_computed_tokens == 0
    assert set(bm.get_block_table(b.seqs[0])).isdisjoint(bm.get_block_table(a.seqs[0]))


def test_lru_eviction_ties_evict_the_block_with_more_tokens_first():
    """Blocks freed together tie on recency: the chain's tail (more tokens) goes first, its shared head stays."""
    bm = prefix_manager(num_device_blocks=5)
    prompt = list(range(13))  # 3 full blocks (4, 8, 12 tokens of prefix) + 1 partial
    a = make_group("a", prompt, 0)
    bm.allocate(a)
    run(a)
    computed(bm, a)
    head, middle, tail = bm.get_block_table(a.seqs[0])[:3]
    bm.free(a.seqs[0])
    assert bm.get_num_free_device_blocks() == 5 and bm.gpu.num_cached() == 3
    # 3 fresh blocks: the 2 uncached free ones, then one eviction, which must take the 12-token tail.
    other = make_group("other", [50 + i for i in range(12)], 1)
    bm.allocate(other)
    assert tail in bm.get_block_table(other.seqs[0])
    assert bm.gpu.num_cached() == 2 and bm.get_num_free_device_blocks() == 2
    probe = make_group("probe", prompt, 2)
    assert bm.can_allocate(probe) is AllocStatus.LATER  # 4 blocks, 2 revived from cache + 2 fresh > 2 free
    bm.free(other.seqs[0])
    bm.allocate(probe)
    assert probe.seqs[0].num_computed_tokens == 8  # head and middle survived
    assert bm.get_block_table(probe.seqs[0])[:2] == [head, middle]
    assert bm.prefix_cache_hit_rate() == pytest.approx(2 / 8)  # a: 0 of 3, other: 0 of 2, probe: 2 of 3
    assert_ref_counts_match_tables(bm)


def test_hash_chain_keys_a_block_by_its_whole_prefix():
    import hashlib
    from array import array

    from engine.core.block_allocator import NO_PREFIX_HASH, hash_block

    first = hash_block(NO_PREFIX_HASH, (1, 2, 3, 4))
    assert first == hashlib.sha256(array("q", (1, 2, 3, 4)).tobytes()).digest()  # sha256 of the int64 tokens
    assert hash_block(first, (5, 6, 7, 8)) != hash_block(hash_block(NO_PREFIX_HASH, (0, 2, 3, 4)), (5, 6, 7, 8))
    bm = prefix_manager()
    a = make_group("a", list(range(1, 10)), 0)
    bm.allocate(a)
    run(a)
    computed(bm, a)  # promotion: the 2 full blocks become findable under their chained hashes
    table = bm.get_block_table(a.seqs[0])
    assert bm.gpu.lookup(first, None, (1, 2, 3, 4)) == table[0]
    assert bm.gpu.lookup(hash_block(first, (5, 6, 7, 8)), table[0], (5, 6, 7, 8)) == table[1]
    assert bm.gpu.lookup(hash_block(NO_PREFIX_HASH, (5, 6, 7, 8)), None, (5, 6, 7, 8)) is None
    assert not bm.gpu.is_cached(table[2])  # the partial block is not promoted


def test_a_hash_collision_never_shares_another_prompts_kv():
    """With a hash that ignores the parent digest, two prompts that differ only in their first block collide on
    the second (what the old Python hash() allowed an attacker to craft). The lookup must miss, not hand out
    K/V computed after another prefix."""
    token_bytes = BS * 8
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0, enable_prefix_caching=True,
                           block_hash_fn=lambda data: data[-token_bytes:])  # the block's own tokens only
    victim = make_group("victim", [1, 2, 3, 4, 9, 9, 9, 9, 0], 0)  # its [9, 9, 9, 9] K/V attend to [1, 2, 3, 4]
    other = make_group("other", [5, 6, 7, 8, 0, 0, 0, 0, 0], 1)  # makes [5, 6, 7, 8] a cached first block
    for group in (victim, other):
        bm.allocate(group)
        run(group)
        computed(bm, group)
    assert bm.gpu.num_cached() == 4
    attacker = make_group("attacker", [5, 6, 7, 8, 9, 9, 9, 9, 0], 2)
    bm.allocate(attacker)
    table = bm.get_block_table(attacker.seqs[0])
    assert table[0] == bm.get_block_table(other.seqs[0])[0]  # the honest hit: same first block
    assert table[1] != bm.get_block_table(victim.seqs[0])[1]  # not the victim's block, despite equal key and tokens
    assert attacker.seqs[0].num_computed_tokens == BS  # its second block is computed afresh
    assert_ref_counts_match_tables(bm)


# -- sliding window: blocks wholly before every future query's window go back to the pool ----------------


def decode_one(bm: BlockSpaceManager, group: SequenceGroup, token: int) -> list:
    """One decode step as the scheduler runs it: a token appended, slots appended when a block is needed,
    then the step's tokens computed. Returns the copy-on-write pairs."""
    cows = []
    for seq in group.get_seqs(SequenceStatus.RUNNING):
        seq.append_token(token, {token: 0.0})
    if bm.num_append_blocks(group.get_seqs(SequenceStatus.RUNNING)):
        cows = [c for seq in group.get_seqs(SequenceStatus.RUNNING) if (c := bm.append_slots(seq)) is not None]
    computed(bm, group)
    return cows


def test_window_releases_blocks_no_query_reads_again():
    window = 6  # a query at position p sees tokens p - 5 .. p
    bm = BlockSpaceManager(BS, 10, 0, watermark=0.0, sliding_window=window)
    group = make_group("a", list(range(10)), 0)  # 3 blocks
    bm.allocate(group)
    run(group)
    computed(bm, group)
    seq = group.seqs[0]
    assert bm.num_released(seq.seq_id) == 0 and bm.get_num_free_device_blocks() == 7
    for token in range(10, 13):  # tokens 10, 11, 12: the third needs block 3
        decode_one(bm, group, token)
    # The step computing token 12 sees tokens 7 .. 12: block 0 (tokens 0-3) goes back, block 1 (4-7) stays.
    assert bm.num_released(seq.seq_id) == 1
    table = bm.get_block_table(seq)
    assert len(table) == 4 and table[0] == RELEASED_BLOCK
    assert bm.get_num_free_device_blocks() == 10 - 3
    assert_ref_counts_match_tables(bm)
    for token in range(13, 60):  # a long decode holds at most ceil(window / BS) + 1 blocks
        decode_one(bm, group, token)
        held = len(bm.get_block_table(seq)) - bm.num_released(seq.seq_id)
        assert held <= -(-window // BS) + 1
        first_needed = seq.get_len() - window  # the next step's query is token get_len(); it sees from here
        assert bm.num_released(seq.seq_id) * BS <= first_needed
        assert_ref_counts_match_tables(bm)
    bm.free(seq)
    assert bm.get_num_free_device_blocks() == 10 and bm.num_released(seq.seq_id) == 0
    assert_ref_counts_match_tables(bm)


def test_window_blocks_are_reused_by_another_sequence():
    # 6 blocks: two long generations fit only because each gives back what its window left behind.
    bm = BlockSpaceManager(BS, 6, 0, watermark=0.0, sliding_window=4)
    groups = [make_group(str(i), [1, 2, 3], i) for i in range(2)]
    for group in groups:
        bm.allocate(group)
        run(group)
        computed(bm, group)
    for token in range(40):  # 43 tokens each: 11 blocks each without the window
        for group in groups:
            assert bm.can_append_slots(group)
            decode_one(bm, group, token)
    assert_ref_counts_match_tables(bm)
    for group in groups:
        bm.free(group.seqs[0])
    assert bm.get_num_free_device_blocks() == 6


def test_window_fork_shares_only_held_blocks():
    bm = BlockSpaceManager(BS, 12, 0, watermark=0.0, sliding_window=5)
    group = make_group("a", list(range(14)), 0, best_of=2)  # 4 blocks
    bm.allocate(group)
    run(group)
    computed(bm, group)
    parent = group.seqs[0]
    decode_one(bm, group, 14)
    decode_one(bm, group, 15)
    decode_one(bm, group, 16)  # token 16 needs block 4; the step sees 12 .. 16: blocks 0-2 released
    assert bm.num_released(parent.seq_id) == 3
    child = parent.fork(1)
    group.add(child)
    bm.fork(parent, child)
    assert bm.num_released(child.seq_id) == 3 and bm.get_block_table(child) == bm.get_block_table(parent)
    assert_ref_counts_match_tables(bm)
    for token in range(17, 30):
        decode_one(bm, group, token)
        assert_ref_counts_match_tables(bm)
    for seq in group.seqs:
        bm.free(seq)
    assert bm.get_num_free_device_blocks() == 12


def test_window_swap_moves_only_held_blocks():
    bm = BlockSpaceManager(BS, 10, 6, watermark=0.0, sliding_window=4)
    group = make_group("a", list(range(15)), 0)  # 4 blocks
    bm.allocate(group)
    run(group)
    computed(bm, group)
    decode_one(bm, group, 15)
    decode_one(bm, group, 16)  # block 4; the step sees 13 .. 16: blocks 0-2 released
    seq = group.seqs[0]
    assert bm.num_released(seq.seq_id) == 3
    assert bm.can_swap_out(group)
    out_map = bm.swap_out(group)
    assert len(out_map) == 2  # the held blocks only
    seq.status = SequenceStatus.SWAPPED
    assert bm.get_num_free_device_blocks() == 10 and bm.get_num_free_cpu_blocks() == 4
    assert_ref_counts_match_tables(bm)
    in_map = bm.swap_in(group)
    run(group)
    assert sorted(in_map) == sorted(out_map.values())
    table = bm.get_block_table(seq)
    assert len(table) == 5 and table[:3] == [RELEASED_BLOCK] * 3 and set(table[3:]) == set(in_map.values())
    assert bm.get_num_free_device_blocks() == 8 and bm.get_num_free_cpu_blocks() == 6
    assert_ref_counts_match_tables(bm)
    computed(bm, group)  # swap-in forgot the hashes; re-registering must skip the released entries
    bm.free(seq)
    assert bm.get_num_free_device_blocks() == 10


def test_window_with_prefix_caching_keeps_released_blocks_findable():
    bm = BlockSpaceManager(BS, 12, 0, watermark=0.0, enable_prefix_caching=True, sliding_window=4)
    prompt = list(range(13))  # 3 full blocks + 1 token
    first = make_group("a", prompt, 0)
    bm.allocate(first)
    run(first)
    computed(bm, first)
    cached = list(bm.get_block_table(first.seqs[0])[:3])
    for token in range(100, 104):
        decode_one(bm, first, token)
    assert bm.num_released(0) == 3  # the step at token 16 sees 13 .. 16
    assert all(bm.gpu.ref_count(b) == 0 and bm.gpu.is_cached(b) for b in cached)  # in the evictor, findable
    second = make_group("b", prompt, 1)
    bm.allocate(second)
    run(second)
    assert bm.get_block_table(second.seqs[0])[:3] == cached and second.seqs[0].num_computed_tokens == 12
    assert_ref_counts_match_tables(bm)
    for group in (first, second):
        bm.free(group.seqs[0])
    assert bm.get_num_free_device_blocks() == 12


def test_window_released_parent_is_never_taken_for_block_zero():
    """A released table entry holds RELEASED_BLOCK, a real block id (0). A block registered after its parent
    was released (here: re-registered after a swap-in) must not chain to whatever block 0 holds: with a hash
    that collides (the block's own tokens only), a prompt starting with block 0's tokens would get its K/V."""
    token_bytes = BS * 8
    bm = BlockSpaceManager(BS, 32, 16, watermark=0.0, enable_prefix_caching=True, sliding_window=BS,
                           block_hash_fn=lambda data: data[-token_bytes:])
    owner = make_group("owner", [7, 7, 7, 7, 0], 0)  # its first block is block 0, cached
    bm.allocate(owner)
    run(owner)
    computed(bm, owner)
    assert bm.get_block_table(owner.seqs[0])[0] == RELEASED_BLOCK and bm.gpu.is_cached(RELEASED_BLOCK)
    windowed = make_group("windowed", [1, 2, 3], 1)
    bm.allocate(windowed)
    run(windowed)
    computed(bm, windowed)
    for token in range(100, 110):
        decode_one(bm, windowed, token)
    seq = windowed.seqs[0]
    released = bm.num_released(seq.seq_id)
    assert released >= 1
    bm.swap_out(windowed)
    seq.status = SequenceStatus.SWAPPED
    filler = make_group("filler", [200] * (BS * bm.get_num_free_device_blocks()), 3)
    bm.allocate(filler)  # takes every free block: the evictor's cached copies of windowed's blocks go
    bm.free(filler.seqs[0])
    bm.swap_in(windowed)
    run(windowed)
    computed(bm, windowed)  # re-registers its held full blocks; the first one's parent was released
    first_held = bm.get_block_table(seq)[released]
    probe = make_group("probe", [7, 7, 7, 7] + seq.all_token_ids[released * BS:(released + 1) * BS] + [0], 2)
    bm.allocate(probe)
    table = bm.get_block_table(probe.seqs[0])
    assert table[0] == RELEASED_BLOCK  # the honest hit on the owner's block
    assert table[1] != first_held and probe.seqs[0].num_computed_tokens == BS
