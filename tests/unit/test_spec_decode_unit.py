"""Speculative decoding's pure parts: the prompt lookup, the cost model's choice, the block manager's draft slots."""
from __future__ import annotations

import numpy as np

from engine.core.block_manager import BlockSpaceManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.spec_decode.ngram import NgramIndex, ngram_propose
from engine.spec_decode.policy import Acceptance, DraftCost, Overhead, Pool, StepCost, choose, expected_accepted


def test_ngram_takes_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert ngram_propose(tokens, 3, 3, 1) == [7, 8, 1]  # "1 2 3" last seen before at 6: 7, 8, 1 followed
    assert ngram_propose(tokens, 9, 3, 1) == [7, 8, 1, 2, 3]  # no more than the text holds
    assert ngram_propose(np.array([4, 4, 5, 6]), 2, 2, 2) == []  # "5 6" never came before
    assert ngram_propose(np.array([4, 5, 6, 5]), 2, 2, 1) == [6, 5]  # falls back to n = 1
    assert ngram_propose(np.array([7]), 3, 3, 1) == []


def test_ngram_index_follows_the_sequence():
    seq = Sequence(0, [1, 2, 3])
    index = NgramIndex()
    assert index.view(seq.get_len(), seq).tolist() == [1, 2, 3]
    for t in range(300):
        seq.output_token_ids.append(t)
        assert index.view(seq.get_len(), seq).tolist() == seq.all_token_ids


def test_choose_speculates_while_rows_are_cheap():
    memory_bound, compute_bound = StepCost(), StepCost()
    for rows in (1, 5, 9, 1, 5, 9) * 20:
        memory_bound.observe(rows, 0.020 + 0.0002 * rows)  # 1 % of a step a row
        compute_bound.observe(rows, 0.001 + 0.002 * rows)  # nearly all of it
    good, poor = (0.8, 4), (0.05, 4)
    assert choose(1, [good], memory_bound) == 1
    assert choose(1, [poor], memory_bound) == 0  # 0.05 tokens for 4 rows do not pay even here
    assert choose(32, [good] * 32, compute_bound) == 0
    assert choose(4, [good, good, poor, poor], memory_bound) == 2
    assert abs(expected_accepted(0.5, 3) - 0.875) < 1e-9 and expected_accepted(1.0, 3) == 3


def test_a_speculating_steps_overhead_stops_it_where_it_does_not_pay_and_fades_while_idle():
    """Eight rows of a memory-bound 20 ms step: one sequence's 3.4 expected tokens pay for four rows by the line,
    not once a speculating step is seen to cost a plain step more (the general path, the steady decode rebuilt);
    a cold first step counts at most two steps; while none speculates the overhead fades and a probe comes."""
    cost, overhead = StepCost(), Overhead()
    for rows in (1, 5, 9, 1, 5, 9) * 20:
        cost.observe(rows, 0.020 + 0.0002 * rows)
    good = (0.9, 4)
    assert choose(8, [good], cost, overhead.seconds()) == 1
    overhead.observe(5.0, cost.seconds(12))  # a cold step: 5 s, counted as 2 plain steps
    assert overhead.seconds() <= 2 * cost.seconds(12) / 3 + 1e-9
    for _ in range(10):
        overhead.observe(0.02, cost.seconds(12))
    assert choose(8, [good], cost, overhead.seconds()) == 0
    assert choose(1, [good], cost, overhead.seconds()) == 1  # one row: 3.4 tokens a step still pay for it
    for _ in range(200):
        overhead.idle()
    assert choose(8, [good], cost, overhead.seconds()) == 1


def test_acceptance_drifts_back_to_a_probe():
    record = Acceptance()
    for _ in range(20):
        record.record(4, 0)
    low = record.alpha()
    assert low < 0.1
    for _ in range(100):
        record.idle()
    assert record.alpha() > 0.5


def test_a_draft_that_pays_for_nobody_is_not_probed_by_every_new_sequence():
    """A poor draft model (1 token of 20 accepted) whose forwards take most of a plain step: a new sequence starts
    from the draft's pooled acceptance and does not speculate, where the fixed prior of 0.6 (a lookup's, whose
    acceptance depends on each text) would probe; the draft's cost is charged before it runs, never forgotten;
    while none speculates the pool drifts back, so the draft is tried again, hundreds of steps later."""
    cost, draft = StepCost(), DraftCost()
    for rows in (1, 5, 9, 1, 5, 9) * 20:
        cost.observe(rows, 0.020 + 0.0002 * rows)
    assert choose(1, [(0.6, 3)], cost, 0.0, draft) == 1  # never measured: nothing charged
    for _ in range(5):
        draft.observe(1, 0.015)
    pool = Pool()
    for i in range(30):
        pool.record(3, 0 if i % 20 else 1)
    fresh = Acceptance()
    assert choose(1, [(fresh.alpha(), 3)], cost, 0.0, draft) == 1  # the fixed prior pays even for the draft
    assert choose(1, [(fresh.alpha(pool.alpha()), 3)], cost, 0.0, draft) == 0
    assert choose(1, [(fresh.alpha(pool.alpha()), 3)], cost, 0.0) == 1  # (its forwards spent: verifying pays)
    for _ in range(100):
        pool.idle()
    assert choose(1, [(fresh.alpha(pool.alpha()), 3)], cost, 0.0, draft) == 0  # not yet
    for _ in range(2000):
        pool.idle()
    assert choose(1, [(fresh.alpha(pool.alpha()), 3)], cost, 0.0, draft) == 1
    for _ in range(2000):
        cost.observe(1, 0.0202)  # the draft's cost stays while the target's line moves on
    assert abs(draft.seconds(1) - 0.015) < 1e-9


def test_draft_slots_grow_and_roll_back():
    bm = BlockSpaceManager(block_size=4, num_device_blocks=8, num_cpu_blocks=0)
    seq = Sequence(0, list(range(6)))
    group = SequenceGroup("r", [seq], SamplingParams())
    bm.allocate(group)
    seq.status = SequenceStatus.RUNNING
    assert len(bm.block_tables[0]) == 2
    assert bm.grow_for_draft(seq, 6 + 5)  # 11 tokens: 3 blocks
    assert len(bm.block_tables[0]) == 3 and bm.get_num_free_device_blocks() == 5
    assert not bm.grow_for_draft(seq, 6 + 40)  # more than the pool has: nothing taken
    assert bm.get_num_free_device_blocks() == 5
    seq.output_token_ids += [7, 8]  # two accepted: 8 tokens, 2 blocks
    bm.truncate(seq, seq.get_len())
    assert len(bm.block_tables[0]) == 2 and bm.get_num_free_device_blocks() == 6
    bm.free(seq)
    assert bm.get_num_free_device_blocks() == 8
