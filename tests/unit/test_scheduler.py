"""Scheduler: queues, budgets, preemption by recompute and swap, aborts, and errors a client can read."""
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig, PreemptionMode, SchedulingPolicy
from engine.sampling_params import SamplingParams
from engine.core.scheduler import BlockActions, Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 8


def make_scheduler(num_device_blocks: int, num_cpu_blocks: int = 16, **overrides) -> Scheduler:
    fields = dict(block_size=BS, max_model_len=64, max_num_batched_tokens=128, max_num_seqs=8, watermark=0.0)
    fields.update(overrides)
    config = EngineConfig(**fields)
    config.resolve(64)
    return Scheduler(config, num_device_blocks, num_cpu_blocks)


_next_seq_id = [0]


def make_group(request_id: str, prompt_len: int, best_of: int = 1, arrival: float = 0.0,
               priority: int = 0) -> SequenceGroup:
    _next_seq_id[0] += 1
    params = SamplingParams(n=1, best_of=best_of, temperature=1.0)
    seq = Sequence(_next_seq_id[0], list(range(prompt_len)))
    return SequenceGroup(request_id, [seq], params, arrival_time=arrival, priority=priority)


def finish_step(sched: Scheduler, out: SchedulerOutput, token: int = 1) -> None:
    """What the engine does after the forward: K/V computed, one token per running sequence."""
    sched.update_computed(out)
    for scheduled in out.scheduled:
        for seq in scheduled.group.get_seqs(SequenceStatus.RUNNING):
            seq.append_token(token, {token: 0.0})


def fork_all(sched: Scheduler, group: SequenceGroup) -> None:
    parent = group.seqs[0]
    for _ in range(group.sampling_params.best_of - 1):
        _next_seq_id[0] += 1
        child = parent.fork(_next_seq_id[0])
        group.add(child)
        sched.apply(BlockActions(forks=[(parent, child)]))


def a_and_forked_b(sched: Scheduler, run_first_step: bool = True) -> tuple[SequenceGroup, SequenceGroup]:
    """a: one sequence of 16 tokens (2 blocks); b: 12 tokens, best_of=2, forked after its prefill (2 shared blocks)."""
    a, b = make_group("a", 16, arrival=1.0), make_group("b", 12, best_of=2, arrival=2.0)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    if run_first_step:
        finish_step(sched, sched.schedule())
        fork_all(sched, b)
    return a, b


def ids(queue) -> list[str]:
    return [group.request_id for group in queue]


def test_prefill_then_decode():
    sched = make_scheduler(num_device_blocks=16)
    sched.add_seq_group(make_group("a", 10))
    sched.add_seq_group(make_group("b", 5))
    out = sched.schedule()
    assert [(s.group.request_id, s.is_prefill, s.num_tokens) for s in out.scheduled] == [("a", True, 10), ("b", True, 5)]
    assert out.num_batched_tokens == 15
    assert {len(t) for t in out.block_tables.values()} == {2, 1}
    finish_step(sched, out)
    out = sched.schedule()
    assert [(s.group.request_id, s.is_prefill, s.num_tokens) for s in out.scheduled] == [("a", False, 1), ("b", False, 1)]
    assert not out.blocks_to_copy and not out.blocks_to_swap_out and not out.blocks_to_swap_in


def test_token_budget_and_max_num_seqs():
    sched = make_scheduler(num_device_blocks=64, max_num_batched_tokens=64, max_num_seqs=3)
    for name in "abcd":
        sched.add_seq_group(make_group(name, 30))
    out = sched.schedule()
    assert [s.group.request_id for s in out.scheduled] == ["a", "b"]  # a third would pass 64 tokens
    finish_step(sched, out)
    out = sched.schedule()
    assert [s.group.request_id for s in out.scheduled] == ["c"]  # prefills first; then 3 seqs is the cap
    finish_step(sched, out)
    out = sched.schedule()
    assert [s.is_prefill for s in out.scheduled] == [False, False, False]
    assert ids(sched.waiting) == ["d"]


def test_best_of_counts_against_max_num_seqs():
    sched = make_scheduler(num_device_blocks=64, max_num_seqs=4)
    sched.add_seq_group(make_group("a", 4, best_of=3))
    sched.add_seq_group(make_group("b", 4, best_of=2))
    assert ids(s.group for s in sched.schedule().scheduled) == ["a"]


def test_too_long_prompt_is_ignored_not_queued():
    sched = make_scheduler(num_device_blocks=16)
    sched.add_seq_group(make_group("long", 65))
    sched.add_seq_group(make_group("ok", 4))
    out = sched.schedule()
    assert ids(out.ignored) == ["long"]
    assert out.ignored[0].seqs[0].status is SequenceStatus.FINISHED_IGNORED
    assert "65 tokens" in out.ignored[0].error and "64" in out.ignored[0].error
    assert ids(s.group for s in out.scheduled) == ["ok"]
    assert ids(sched.waiting) == [] and ids(sched.running) == ["ok"] and not sched.swapped
    assert sched.block_manager.get_num_free_device_blocks() == 15  # only "ok" holds a block


def test_prompt_that_never_fits_the_cache_ends_with_an_error():
    sched = make_scheduler(num_device_blocks=4)  # 32 tokens of cache, max_model_len 64
    sched.add_seq_group(make_group("huge", 40))
    out = sched.schedule()
    assert ids(out.ignored) == ["huge"] and not sched.has_unfinished_seqs()
    assert "5 KV cache blocks" in out.ignored[0].error
    assert sched.block_manager.get_num_free_device_blocks() == 4


def test_can_allocate_later_keeps_waiting():
    sched = make_scheduler(num_device_blocks=4)
    sched.add_seq_group(make_group("a", 24))  # 3 blocks
    sched.add_seq_group(make_group("b", 16))  # 2 blocks: later
    out = sched.schedule()
    assert ids(s.group for s in out.scheduled) == ["a"] and ids(sched.waiting) == ["b"]
    finish_step(sched, out)
    assert ids(s.group for s in sched.schedule().scheduled) == ["a"]
    assert ids(sched.waiting) == ["b"] and not out.ignored


def test_recompute_preemption_frees_blocks_and_requeues_at_the_front():
    sched = make_scheduler(num_device_blocks=4)
    a, b = make_group("a", 16, arrival=1.0), make_group("b", 16, arrival=2.0)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    sched.add_seq_group(make_group("c", 4, arrival=3.0))
    out = sched.schedule()
    assert ids(s.group for s in out.scheduled) == ["a", "b"]
    finish_step(sched, out)
    out = sched.schedule()  # a needs a third block: b, the latest arrival, is preempted
    assert out.num_preempted_recompute == 1 and out.num_preempted_swap == 0
    assert not out.blocks_to_swap_out and not out.blocks_to_swap_in  # recompute moves no bytes
    assert ids(s.group for s in out.scheduled) == ["a"]
    assert ids(sched.waiting) == ["b", "c"]
    seq_b = b.seqs[0]
    assert seq_b.status is SequenceStatus.WAITING and seq_b.num_computed_tokens == 0 and seq_b.get_len() == 17
    assert sched.block_manager.get_num_free_device_blocks() == 1
    # Once a finishes, b is prefilled again over its prompt and its output.
    finish_step(sched, out)
    a.seqs[0].status = SequenceStatus.FINISHED_LENGTH_CAPPED
    sched.apply(BlockActions(frees=[a.seqs[0]]))
    sched.free_finished_seq_groups()
    out = sched.schedule()
    assert [(s.group.request_id, s.num_tokens) for s in out.scheduled] == [("b", 17), ("c", 4)]


def test_best_of_two_is_preempted_by_swap_and_swapped_come_before_new_prefills():
    sched = make_scheduler(num_device_blocks=5, num_cpu_blocks=8)
    a, b = a_and_forked_b(sched)
    assert sched.block_manager.get_num_free_device_blocks() == 1
    out = sched.schedule()  # a needs a block; b needs two (one copy-on-write): b goes out
    assert out.num_preempted_swap == 1 and len(out.blocks_to_swap_out) == 2
    assert ids(sched.swapped) == ["b"] and all(s.status is SequenceStatus.SWAPPED for s in b.seqs)
    assert sched.block_manager.get_num_free_cpu_blocks() == 6
    swapped_to = set(out.blocks_to_swap_out.values())
    sched.add_seq_group(make_group("new", 4, arrival=3.0))
    finish_step(sched, out)
    a.seqs[0].status = SequenceStatus.FINISHED_STOPPED
    sched.apply(BlockActions(frees=[a.seqs[0]]))
    sched.free_finished_seq_groups()
    out = sched.schedule()
    assert ids(s.group for s in out.scheduled) == ["b"]  # "new" waits for the swapped group
    assert set(out.blocks_to_swap_in) == swapped_to
    assert len(out.blocks_to_copy) == 1  # the siblings' shared last block, copied once
    src, dst = out.blocks_to_copy[0]
    assert src != dst and src in out.blocks_to_swap_in.values()
    assert ids(sched.waiting) == ["new"] and sched.block_manager.get_num_free_cpu_blocks() == 8


def test_out_of_swap_space_ends_only_that_request():
    sched = make_scheduler(num_device_blocks=5, num_cpu_blocks=1)
    a, b = a_and_forked_b(sched)
    out = sched.schedule()
    assert ids(out.ignored) == ["b"] and all(s.status is SequenceStatus.FINISHED_ERROR for s in b.seqs)
    assert "swap space" in b.error and "--swap-space" in b.error
    assert ids(s.group for s in out.scheduled) == ["a"] and not out.blocks_to_swap_out
    assert sched.block_manager.get_num_free_device_blocks() == 2  # b's blocks came back
    assert ids(sched.running) == ["a"] and not sched.swapped


def test_infeasible_swap_in_ends_the_request():
    sched = make_scheduler(num_device_blocks=4, num_cpu_blocks=8, preemption_mode="swap")
    a = make_group("a", 32)  # fills the cache
    sched.add_seq_group(a)
    finish_step(sched, sched.schedule())
    out = sched.schedule()  # a needs a fifth block: it swaps itself out, nothing runs
    assert out.num_preempted_swap == 1 and not out.scheduled and out.blocks_to_swap_out
    out = sched.schedule()
    assert ids(out.ignored) == ["a"] and a.seqs[0].status is SequenceStatus.FINISHED_ERROR
    assert not sched.has_unfinished_seqs()
    assert sched.block_manager.get_num_free_cpu_blocks() == 8


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_in_each_queue_frees_every_block(where):
    sched = make_scheduler(num_device_blocks=5, num_cpu_blocks=8)
    a, b = a_and_forked_b(sched, run_first_step=where != "waiting")
    if where == "swapped":
        sched.schedule()
    assert ids(getattr(sched, where)) == (["a", "b"] if where != "swapped" else ["b"])
    aborted = sched.abort_seq_group("b")
    assert aborted == [b] and all(s.status is SequenceStatus.FINISHED_ABORTED for s in b.seqs)
    assert "b" not in ids(sched.waiting) + ids(sched.running) + ids(sched.swapped)
    assert sched.block_manager.get_num_free_cpu_blocks() == 8
    a_blocks = len(sched.block_manager.block_tables.get(a.seqs[0].seq_id, []))
    assert sched.block_manager.get_num_free_device_blocks() == 5 - a_blocks
    sched.abort_seq_group(["a", "unknown"])
    assert not sched.has_unfinished_seqs() and sched.block_manager.get_num_free_device_blocks() == 5


def test_preempt_then_abort():
    sched = make_scheduler(num_device_blocks=4)
    a, b = make_group("a", 16, arrival=1.0), make_group("b", 16, arrival=2.0)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    finish_step(sched, sched.schedule())
    sched.schedule()
    assert ids(sched.waiting) == ["b"]
    sched.abort_seq_group("b")
    assert ids(sched.waiting) == [] and b.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert sched.block_manager.get_num_free_device_blocks() == 1


def test_priority_policy_runs_lower_values_first():
    sched = make_scheduler(num_device_blocks=4, scheduling_policy=SchedulingPolicy.PRIORITY)
    sched.add_seq_group(make_group("low", 24, arrival=1.0, priority=5))
    sched.add_seq_group(make_group("high", 24, arrival=2.0, priority=0))
    assert ids(s.group for s in sched.schedule().scheduled) == ["high"]


def test_config_must_be_resolved():
    with pytest.raises(ValueError, match="resolve"):
        Scheduler(EngineConfig(), 4, 4)


def test_block_size_defaults_to_the_devices_and_cuda_keeps_its_own_sizes():
    assert EngineConfig(device="cpu").block_size == 128 and EngineConfig(device="cuda").block_size == 16
    auto = EngineConfig()
    assert auto.block_size is None  # until the engine knows its device
    auto.resolve_block_size("cpu")
    assert auto.block_size == 128
    assert EngineConfig(device="cpu", block_size=16).block_size == 16
    with pytest.raises(ValueError, match="8, 16 or 32 on CUDA"):
        EngineConfig(device="cuda", block_size=128)
    with pytest.raises(ValueError, match="block_size must be 8, 16, 32, 64 or 128"):
        EngineConfig(block_size=24)


def test_preemption_mode_recompute_applies_to_groups_of_several():
    sched = make_scheduler(num_device_blocks=5, preemption_mode=PreemptionMode.RECOMPUTE)
    a, b = a_and_forked_b(sched)
    out = sched.schedule()
    assert out.num_preempted_recompute == 1 and not out.blocks_to_swap_out
    assert [s.status for s in b.seqs] == [SequenceStatus.WAITING] * 2


def test_groups_swapped_out_in_one_step_come_back_in_arrival_order():
    sched = make_scheduler(num_device_blocks=4, num_cpu_blocks=8)
    groups = [make_group("a", 16, arrival=1.0), make_group("b", 4, best_of=2, arrival=2.0),
              make_group("c", 4, best_of=2, arrival=3.0)]
    for group in groups:
        sched.add_seq_group(group)
    finish_step(sched, sched.schedule())
    fork_all(sched, groups[1])
    fork_all(sched, groups[2])
    out = sched.schedule()  # a grows: c goes out, then b cannot copy its shared block and goes out too
    assert out.num_preempted_swap == 2 and ids(sched.swapped) == ["b", "c"]
    finish_step(sched, out)
    groups[0].seqs[0].status = SequenceStatus.FINISHED_STOPPED
    sched.apply(BlockActions(frees=[groups[0].seqs[0]]))
    sched.free_finished_seq_groups()
    out = sched.schedule()
    # b needs 1 block + 1 per sequence to resume; c's 3 more do not fit beside it yet.
    assert ids(s.group for s in out.scheduled) == ["b"] and ids(sched.swapped) == ["c"]


def test_priority_policy_preempts_lower_priority_running_groups():
    sched = make_scheduler(num_device_blocks=4, scheduling_policy="priority")
    low_old, low_new = make_group("low-old", 16, arrival=1.0, priority=2), make_group("low-new", 16, arrival=2.0, priority=1)
    sched.add_seq_group(low_old)
    sched.add_seq_group(low_new)
    finish_step(sched, sched.schedule())
    sched.add_seq_group(make_group("urgent", 16, arrival=3.0, priority=0))
    sched.add_seq_group(make_group("later", 16, arrival=4.0, priority=3))
    out = sched.schedule()
    # The lowest priority goes first (low-old, priority 2), not the latest arrival.
    assert out.num_preempted_recompute == 1 and ids(s.group for s in out.scheduled) == ["urgent"]
    assert ids(sched.running) == ["low-new", "urgent"] and ids(sched.waiting) == ["low-old", "later"]
    assert low_old.seqs[0].num_computed_tokens == 0 and sched.block_manager.get_num_free_device_blocks() == 0


def test_engine_core_never_imports_torch():
    """The scheduler runs on a CPU-only frontend too: no torch import behind it."""
    code = ("import sys; import engine.core.block_allocator, engine.core.block_manager, engine.core.scheduler; "
            "print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_watermark_blocks_admission_matches_the_startup_helper():
    """max_admissible_tokens() is what can_allocate admits in an empty cache: the startup check's bound."""
    from engine.core.block_manager import max_admissible_tokens, watermark_blocks

    sched = make_scheduler(num_device_blocks=8, watermark=0.25, max_model_len=64)  # 2 watermark blocks: 48 tokens
    assert watermark_blocks(8, 0.25) == 2 and max_admissible_tokens(BS, 8, 0.25) == 48
    sched.add_seq_group(make_group("fits", 48))
    sched.add_seq_group(make_group("over", 49))
    out = sched.schedule()
    assert ids(s.group for s in out.scheduled) == ["fits"]
    # 49 tokens pass max_model_len (64) but never fit beside the watermark: ended, not queued forever.
    assert ids(out.ignored) == ["over"] and "7 KV cache blocks" in out.ignored[0].error
    assert out.ignored[0].seqs[0].status is SequenceStatus.FINISHED_IGNORED
    assert ids(sched.waiting) == [] and ids(sched.running) == ["fits"]
    assert sched.block_manager.get_num_free_device_blocks() == 2
    sched.abort_seq_group("fits")
    assert not sched.has_unfinished_seqs() and sched.block_manager.get_num_free_device_blocks() == 8


# -- chunked prefill ---------------------------------------------------------------------------------------------

def make_chunked(num_device_blocks: int = 32, budget: int = 16, **overrides) -> Scheduler:
    return make_scheduler(num_device_blocks, enable_chunked_prefill=True, max_num_batched_tokens=budget,
                          max_num_seqs=4, **overrides)


def finish_chunked_step(sched: Scheduler, out: SchedulerOutput, token: int = 1) -> None:
    """As finish_step, but a prompt chunk short of the prompt's end gets no token."""
    sched.update_computed(out)
    for scheduled in out.scheduled:
        if scheduled.do_sample:
            for seq in scheduled.group.get_seqs(SequenceStatus.RUNNING):
                seq.append_token(token, {token: 0.0})


def step_summary(out: SchedulerOutput) -> list[tuple[str, bool, int, bool]]:
    return [(s.group.request_id, s.is_prefill, s.num_tokens, s.do_sample) for s in out.scheduled]


def test_chunked_prefill_decodes_first_then_prompt_chunks():
    sched = make_chunked(budget=16)
    a, b = make_group("a", 6), make_group("b", 40)
    sched.add_seq_group(a)
    out = sched.schedule()
    assert step_summary(out) == [("a", True, 6, True)]
    finish_chunked_step(sched, out)
    sched.add_seq_group(b)  # longer than the budget: admitted all the same, in chunks
    steps = []
    while b.seqs[0].num_uncomputed_tokens() > 1 or not steps:
        out = sched.schedule()
        assert out.num_batched_tokens <= 16
        steps.append(step_summary(out))
        finish_chunked_step(sched, out)
    # a decodes in every step; b takes what is left: 15, 15, then the last 10.
    assert steps == [[("a", False, 1, True), ("b", True, 15, False)],
                     [("a", False, 1, True), ("b", True, 15, False)],
                     [("a", False, 1, True), ("b", True, 10, True)]]
    assert b.seqs[0].num_computed_tokens == 40 and b.seqs[0].get_output_len() == 1
    assert step_summary(sched.schedule()) == [("a", False, 1, True), ("b", False, 1, True)]
    # Every block of b was allocated when it was admitted.
    assert len(sched.block_manager.block_tables[b.seqs[0].seq_id]) == 6


def test_a_chunk_may_leave_one_token_which_is_still_a_prefill():
    sched = make_chunked(budget=16)
    group = make_group("a", 17)
    sched.add_seq_group(group)
    out = sched.schedule()
    assert step_summary(out) == [("a", True, 16, False)]
    finish_chunked_step(sched, out)
    # One prompt token left: the scheduler says a one-token prefill chunk that samples, not a decode.
    assert step_summary(sched.schedule()) == [("a", True, 1, True)]


def test_chunked_prompt_limit_is_max_model_len():
    sched = make_chunked(budget=16)
    sched.add_seq_group(make_group("too-long", 65))
    sched.add_seq_group(make_group("fits", 64))
    out = sched.schedule()
    assert step_summary(out) == [("fits", True, 16, False)]
    assert ids(out.ignored) == ["too-long"] and "limit of 64 tokens" in out.ignored[0].error


def test_prompt_preempted_between_chunks_starts_over():
    sched = make_chunked(num_device_blocks=6, budget=8)
    a, b = make_group("a", 6, arrival=1.0), make_group("b", 40, arrival=2.0)  # 1 block, 5 blocks
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append(step_summary(out))
        finish_chunked_step(sched, out)
    assert steps == [[("a", True, 6, True), ("b", True, 2, False)],
                     [("a", False, 1, True), ("b", True, 7, False)],
                     [("a", False, 1, True), ("b", True, 7, False)]]
    out = sched.schedule()  # a's ninth token needs a second block: b, the latest arrival, gives back its five
    assert out.num_preempted_recompute == 1 and ids(sched.waiting) == ["b"]
    assert b.seqs[0].num_computed_tokens == 0 and b.seqs[0].status is SequenceStatus.WAITING
    assert step_summary(out) == [("a", False, 1, True)]  # nothing new starts in a step that preempted
    assert sched.block_manager.get_num_free_device_blocks() == 4


@pytest.mark.parametrize("mode", [None, "swap"])
def test_best_of_prompt_preempted_between_chunks_is_recomputed_not_swapped(mode):
    # Swapped out mid-prompt, it came back as a "decode" of its 33 remaining tokens (found by the property test).
    sched = make_chunked(num_device_blocks=6, budget=8, preemption_mode=mode)
    a, b = make_group("a", 6, arrival=1.0), make_group("b", 40, best_of=2, arrival=2.0)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    for _ in range(3):
        finish_chunked_step(sched, sched.schedule())
    out = sched.schedule()  # a needs a block; b, mid-prompt, goes back to waiting
    assert out.num_preempted_recompute == 1 and out.num_preempted_swap == 0 and not out.blocks_to_swap_out
    assert ids(sched.waiting) == ["b"] and b.seqs[0].num_computed_tokens == 0
    assert sched.block_manager.get_num_free_cpu_blocks() == 16  # nothing went to the swap space


def test_chunked_priority_preempts_before_any_decode_is_scheduled():
    sched = make_chunked(num_device_blocks=4, budget=16, scheduling_policy="priority")
    low = make_group("low", 16, arrival=1.0, priority=2)
    sched.add_seq_group(low)
    finish_chunked_step(sched, sched.schedule())
    sched.add_seq_group(make_group("urgent", 30, arrival=2.0, priority=0))
    out = sched.schedule()
    assert out.num_preempted_recompute == 1 and ids(sched.waiting) == ["low"]
    assert step_summary(out) == [("urgent", True, 16, False)]  # low is not decoded in the step it left


def test_without_chunking_a_prompt_over_the_budget_is_refused():
    sched = make_scheduler(num_device_blocks=32, max_model_len=64, max_num_batched_tokens=64)
    sched.add_seq_group(make_group("a", 40))
    assert step_summary(sched.schedule()) == [("a", True, 40, True)]
    with pytest.raises(ValueError, match="enable-chunked-prefill"):
        EngineConfig(max_model_len=64, max_num_batched_tokens=32).resolve(64)
    config = EngineConfig(enable_chunked_prefill=True, max_num_seqs=8)
    config.resolve(8192)
    assert config.max_num_batched_tokens == 512


def test_a_steady_decode_touches_only_the_rows_entering_a_block():
    """Once every running group decodes, the next steps reuse that step's list: the block manager sees only the
    sequences whose next token starts a block, and every table still covers its sequence, as listing them does."""
    runs = {}
    for steady in (True, False):
        sched = make_scheduler(num_device_blocks=64, max_model_len=64)
        sched._steady_allowed = steady
        groups = [make_group(f"r{i}", n) for i, n in enumerate((3, 8, 9, 14, 17))]
        for group in groups:
            sched.add_seq_group(group)
        finish_step(sched, sched.schedule())  # the prefills
        seen = []
        for step in range(30):
            out = sched.schedule()
            assert all(not sg.is_prefill for sg in out.scheduled) and len(out.scheduled) == len(groups)
            for sg in out.scheduled:
                seq = sg.group.seqs[0]
                assert len(out.block_tables[seq.seq_id]) == sched.block_manager.blocks_for(seq.get_len())
            if steady and step > 0:
                assert out.steady is not None and out.steady.version == seen[0][0]
                # exactly the rows whose last token starts a new block (length 1 past a multiple of BS)
                assert sorted(out.steady_grown) == [r for r, g in enumerate(groups)
                                                    if g.seqs[0].get_len() % BS == 1]
            seen.append((out.steady.version if out.steady else None, [list(t) for t in out.block_tables.values()]))
            finish_step(sched, out)
        runs[steady] = [tables for _, tables in seen]
        # A group leaving drops the steady decode: the next step lists the groups again.
        sched.abort_seq_group("r0")
        if steady:
            assert sched.schedule().steady.version != seen[0][0]
    assert runs[True] == runs[False]
