"""Random sequences of engine-core operations against a small cache; the block invariants hold after every step.

Operations: add a request, schedule, a simulated model step (append a token,
fork best_of samples after the prompt, finish some sequences), fork a running
sequence (as beam search does), abort, and forced preemption. After every step:
free + used = total in each pool, every ref count equals the number of block
tables that hold the block, a sequence's table lives in exactly one pool and
only while the sequence is live, and once every request has ended all blocks
are free (evictable prefix-cached blocks count as free).
"""
from collections import Counter
from typing import Optional

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.core.block_allocator import BlockAllocator
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.core.scheduler import BlockActions, Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 8
MAX_MODEL_LEN = 64
VOCAB = 3  # tiny, so prompts share prefixes and the prefix cache gets hits


def check_pool(alloc: BlockAllocator, tables: dict[int, list[int]]) -> None:
    uses = Counter(block for table in tables.values() for block in table)
    used = [block for block in range(alloc.num_blocks) if alloc.ref_count(block) > 0]
    assert alloc.num_free() + len(used) == alloc.num_blocks
    for block in range(alloc.num_blocks):
        assert alloc.ref_count(block) == uses[block], f"block {block}: ref {alloc.ref_count(block)}, {uses[block]} tables"
    # The free list and the evictor hold each ref-0 block exactly once, and nothing else.
    free_blocks = list(alloc._free) + list(alloc._evictor)
    assert sorted(free_blocks) == [b for b in range(alloc.num_blocks) if alloc.ref_count(b) == 0]


class EngineCoreMachine(RuleBasedStateMachine):
    """The scheduler and its block manager, driven the way the engine drives them."""

    @initialize(num_device_blocks=st.integers(4, 14), num_cpu_blocks=st.integers(0, 16),
                mode=st.sampled_from([None, "recompute", "swap"]), caching=st.booleans(),
                policy=st.sampled_from(["fcfs", "priority"]), watermark=st.sampled_from([0.0, 0.1]),
                budget=st.sampled_from([None, 6, 16]))
    def setup(self, num_device_blocks, num_cpu_blocks, mode, caching, policy, watermark, budget):
        # budget: None, whole prompts in prefill-only steps; else chunked prefill with that token budget.
        config = EngineConfig(block_size=BS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget or 64,
                              max_num_seqs=6, watermark=watermark, preemption_mode=mode, enable_prefix_caching=caching,
                              scheduling_policy=policy, enable_chunked_prefill=budget is not None)
        config.resolve(MAX_MODEL_LEN)
        self.sched = Scheduler(config, num_device_blocks, num_cpu_blocks)
        self.groups: list[SequenceGroup] = []
        self.next_seq_id = 0
        self.last_out: Optional[SchedulerOutput] = None

    def new_seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    def live_groups(self) -> list[SequenceGroup]:
        return [g for g in self.groups if not g.is_finished()]

    # -- operations --------------------------------------------------------------------

    @precondition(lambda self: len(self.groups) < 10)
    @rule(prompt=st.integers(1, MAX_MODEL_LEN + 4).flatmap(
              lambda n: st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)),
          best_of=st.integers(1, 3), max_tokens=st.integers(1, 12), priority=st.integers(0, 2))
    def add(self, prompt, best_of, max_tokens, priority):
        params = SamplingParams(best_of=best_of, max_tokens=max_tokens, temperature=1.0)
        group = SequenceGroup(f"r{len(self.groups)}", [Sequence(self.new_seq_id(), prompt)], params,
                              arrival_time=float(len(self.groups)), priority=priority)
        self.groups.append(group)
        self.sched.add_seq_group(group)

    @precondition(lambda self: self.last_out is None)  # the engine runs the model between two schedule() calls
    @rule()
    def schedule(self):
        out = self.sched.schedule()
        for scheduled in out.scheduled:
            seqs = scheduled.group.get_seqs(SequenceStatus.RUNNING)
            assert seqs and all(out.block_tables[s.seq_id] == self.sched.block_manager.block_tables[s.seq_id]
                                for s in seqs)
        over = out.num_batched_tokens > self.sched.max_num_batched_tokens
        # Only chunked prefill overruns, for a recomputed group of several sequences, the one prompt of its step.
        prompts = [sg for sg in out.scheduled if sg.is_prefill]
        assert not over or (self.sched.chunked_prefill and len(prompts) == 1 and len(prompts[0].group.seqs) > 1)
        for sg in out.scheduled:
            running = sg.group.get_seqs(SequenceStatus.RUNNING)
            assert sg.do_sample or (sg.is_prefill and len(running) == 1 and
                                    sg.num_tokens < running[0].num_uncomputed_tokens())
            assert sg.is_prefill or sg.num_tokens == len(running)  # a decode computes one token per sequence
        for group in out.ignored:
            assert group.is_finished() and group.error
        self.last_out = out

    @precondition(lambda self: self.last_out is not None)
    @rule(rnd=st.randoms(use_true_random=False))
    def model_step(self, rnd):
        """After the forward: K/V computed; best_of forks after the prompt; one token per sequence; some finish."""
        sched, out = self.sched, self.last_out
        self.last_out = None
        sched.update_computed(out)
        for scheduled in out.scheduled:
            group = scheduled.group
            if not scheduled.do_sample:  # a prompt chunk short of the prompt's end: no token yet
                continue
            running = group.get_seqs(SequenceStatus.RUNNING)  # empty if aborted or preempted since schedule()
            params = group.sampling_params
            if len(group.seqs) == 1 and running and running[0].get_output_len() == 0:
                for _ in range(params.best_of - 1):
                    child = running[0].fork(self.new_seq_id())
                    group.add(child)
                    sched.apply(BlockActions(forks=[(running[0], child)]))
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                token = rnd.randrange(VOCAB)
                seq.append_token(token, {token: 0.0})
                if (seq.get_output_len() >= params.max_tokens or seq.get_len() >= MAX_MODEL_LEN
                        or rnd.random() < 0.1):
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    sched.apply(BlockActions(frees=[seq]))
        sched.free_finished_seq_groups()

    @rule(rnd=st.randoms(use_true_random=False))
    def engine_step(self, rnd):
        """schedule() then the model step, back to back as the engine runs them."""
        if self.last_out is not None:
            self.model_step(rnd)
        self.schedule()
        self.model_step(rnd)

    @rule(data=st.data())
    def fork(self, data):
        """Beam search forks a running sequence that has computed K/V."""
        candidates = [s for g in self.sched.running for s in g.get_seqs(SequenceStatus.RUNNING)
                      if len(g.seqs) < 5 and s.num_computed_tokens > 0 and s.num_uncomputed_tokens() <= 1]
        if not candidates:
            return
        parent = data.draw(st.sampled_from(candidates))
        group = next(g for g in self.sched.running if parent in g.seqs)
        child = parent.fork(self.new_seq_id())
        group.add(child)
        self.sched.apply(BlockActions(forks=[(parent, child)]))

    @rule(data=st.data())
    def abort(self, data):
        if not self.groups:
            return
        group = data.draw(st.sampled_from(self.groups))
        was_live = not group.is_finished()
        aborted = self.sched.abort_seq_group(group.request_id)
        assert aborted == ([group] if was_live else [])
        assert group.is_finished()
        assert all(s.seq_id not in self.sched.block_manager.block_tables for s in group.seqs)

    @rule(data=st.data())
    def force_preempt(self, data):
        """Preempt a running group as the decode loop does when blocks run out (mode per config)."""
        if not self.sched.running:
            return
        victim = data.draw(st.sampled_from(list(self.sched.running)))
        if victim.is_finished():
            return
        self.sched.running.remove(victim)
        out = SchedulerOutput()
        self.sched._preempt(victim, out)  # the private step the decode loop takes; no public trigger exists
        if out.num_preempted_recompute:
            assert not out.blocks_to_swap_out and victim in self.sched.waiting
        elif out.num_preempted_swap:
            assert victim in self.sched.swapped and len(out.blocks_to_swap_out) > 0
        else:
            assert out.ignored == [victim]  # out of swap space: only this request ends

    @rule()
    def abort_everything(self):
        self.sched.abort_seq_group([g.request_id for g in self.groups])
        self.last_out = None
        self.check_all_free()

    # -- invariants --------------------------------------------------------------------

    def check_all_free(self):
        bm = self.sched.block_manager
        assert not self.sched.has_unfinished_seqs()
        assert bm.get_num_free_device_blocks() == bm.num_device_blocks
        assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
        assert not bm.block_tables and not bm.cpu_block_tables

    @invariant()
    def pools_are_consistent(self):
        bm = self.sched.block_manager
        check_pool(bm.gpu, bm.block_tables)
        check_pool(bm.cpu, bm.cpu_block_tables)
        # A sequence's blocks live in exactly one pool, and only while it is live there.
        assert not set(bm.block_tables) & set(bm.cpu_block_tables)
        queues = {"waiting": self.sched.waiting, "running": self.sched.running, "swapped": self.sched.swapped}
        on_gpu = {s.seq_id for g in queues["running"] for s in g.get_seqs(SequenceStatus.RUNNING)}
        on_cpu = {s.seq_id for g in queues["swapped"] for s in g.get_seqs(SequenceStatus.SWAPPED)}
        assert set(bm.block_tables) == on_gpu
        assert set(bm.cpu_block_tables) == on_cpu
        for group in queues["waiting"]:
            assert all(s.status in (SequenceStatus.WAITING,) or s.is_finished() for s in group.seqs)
        # Every unfinished request is in exactly one queue; finished ones are in none.
        placement = Counter(id(g) for q in queues.values() for g in q)
        for group in self.groups:
            assert placement[id(group)] == (0 if group.is_finished() else 1), group

    @invariant()
    def everything_free_once_all_requests_ended(self):
        if not self.live_groups():
            self.check_all_free()

    def teardown(self):
        if hasattr(self, "sched"):
            self.abort_everything()


EngineCoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestEngineCore = EngineCoreMachine.TestCase
