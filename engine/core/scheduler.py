"""The three queues (waiting, running, swapped), the step budget and preemption; pure Python, no torch."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional, Union

from engine.core.block_manager import AllocStatus, BlockSpaceManager
from engine.config import EngineConfig, PreemptionMode, SchedulingPolicy
from engine.sequence import Sequence, SequenceGroup, SequenceStatus


class ScheduledGroup(NamedTuple):
    """A group that runs this step, and the scheduler's decision about the step; the runner, the sampler and
    the engine read these fields and derive nothing from token counts.

    is_prefill True: each RUNNING sequence computes its uncomputed tokens as one span (a prompt, a prompt
    recomputed after preemption, or a chunk of it), however many they are, one included. False: a decode, one
    token per RUNNING sequence. A chunk short of the prompt's end (chunked prefill, one sequence) computes only
    the next `num_tokens` tokens and has `do_sample` False: nothing is sampled for it until the chunk that
    reaches the end.
    """

    group: SequenceGroup
    is_prefill: bool
    num_tokens: int  # tokens computed this step, over all its RUNNING sequences
    do_sample: bool = True

    def span_end(self, seq: Sequence) -> int:
        """Where this step's computed tokens of `seq` (one of the group's RUNNING sequences) end."""
        return seq.get_len() if self.do_sample else seq.num_computed_tokens + self.num_tokens


@dataclass
class BlockActions:
    """What a step's outputs ask of the blocks (the output processor decides, the engine applies them)."""

    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child): child shares its blocks
    frees: list[Sequence] = field(default_factory=list)  # sequences whose blocks are no longer needed


@dataclass
class SchedulerOutput:
    """What one step runs, and the cache operations to apply first: swap out, swap in, copy."""

    scheduled: list[ScheduledGroup] = field(default_factory=list)
    # seq_id -> its live block table; read it before the next schedule() call.
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)  # gpu block -> cpu block
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)  # cpu block -> gpu block
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on the device
    # Groups ended at schedule time, status set and `error` a sentence for the client.
    ignored: list[SequenceGroup] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_preempted_recompute: int = 0
    num_preempted_swap: int = 0
    # The step's decodes came from this snapshot (every running group, in its order); None: listed one by one.
    steady: Optional["SteadyDecode"] = None
    # Rows of `steady` whose block table grew this step (the others' tables are as in the step before).
    steady_grown: list[int] = field(default_factory=list)
    # Speculative decoding (engine/spec_decode/): seq_id -> tokens proposed after a decoding sequence's last one;
    # the step runs them as decode rows of their own (one logits row each) and never as a steady decode.
    drafts: dict[int, list[int]] = field(default_factory=dict)


class SteadyDecode:
    """A step in which every running group decoded and nothing was preempted, kept for the steps after it.

    While no group joins, leaves, forks or frees (each of those drops it), the next steps decode the same
    sequences in the same order, each one token longer: only the few crossing into a new block need the block
    manager, so a decode step costs what changed, not what runs. `version` names it for the model runner, which
    keeps its input batch while the version stays.
    """

    def __init__(self, version: int, scheduled: list[ScheduledGroup], block_size: int,
                 tables: dict[int, list[int]]) -> None:
        self.version = version
        self.scheduled = scheduled
        self.rows: list[tuple[SequenceGroup, Sequence]] = [
            (sg.group, seq) for sg in scheduled for seq in sg.group.seqs if seq.status is SequenceStatus.RUNNING]
        self.num_tokens = len(self.rows)
        self.block_tables = {seq.seq_id: tables[seq.seq_id] for _, seq in self.rows}  # live lists
        self.block_size = block_size
        self.steps = 0  # decode steps since the one that built it
        self.armed = False  # update_computed ran for the last step: each sequence is one sampled token longer
        # Row indices by length modulo the block size: a row grows a block when its length reaches 1 past a
        # multiple of it, which every row does in turn, one phase per step.
        self.by_phase: dict[int, list[int]] = {}
        for row, (_, seq) in enumerate(self.rows):
            self.by_phase.setdefault(seq.get_len() % block_size, []).append(row)

    def due(self) -> list[int]:
        """The rows whose next token starts a block, at the next step (steps + 1)."""
        return self.by_phase.get((1 - (self.steps + 1)) % self.block_size, [])


class Scheduler:
    """Decides each step which groups prefill, which decode, and which are preempted by recompute or swap.

    Default (vLLM's v0 rules, docs/internals.md): a step either prefills whole prompts or decodes every running
    group. With `enable_chunked_prefill` a step mixes both under one token budget: every running decode first,
    then the next chunk of prompts already started, then swapped groups, then new prompts, the last one cut to
    what is left of the budget (a long prompt takes several steps, and the decodes go on meanwhile).
    """

    def __init__(self, config: EngineConfig, num_device_blocks: int, num_cpu_blocks: int,
                 sliding_window: Optional[int] = None) -> None:
        if config.max_model_len is None or config.max_num_batched_tokens is None:
            raise ValueError("EngineConfig.resolve() must run before the Scheduler is built.")
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.chunked_prefill = config.enable_chunked_prefill
        self.preemption_mode = config.preemption_mode
        self.policy = config.scheduling_policy
        self.block_manager = BlockSpaceManager(
            config.block_size, num_device_blocks, num_cpu_blocks, config.watermark, config.enable_prefix_caching,
            sliding_window,
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        # The running groups' steady decode (None: the next decode step lists them one by one).
        self._steady: Optional[SteadyDecode] = None
        self._steady_version = 0
        # A window or priority order changes tables or order between steps: every step lists the groups.
        self._steady_allowed = sliding_window is None and self.policy is not SchedulingPolicy.PRIORITY

    # -- requests ------------------------------------------------------------------

    def add_seq_group(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def abort_seq_group(self, request_ids: Union[str, Iterable[str]]) -> list[SequenceGroup]:
        """End the groups with these ids in whichever queue they are, freeing every block."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self._steady = None
        aborted: list[SequenceGroup] = []
        for name in ("waiting", "running", "swapped"):
            kept: deque[SequenceGroup] = deque()
            for group in getattr(self, name):
                if group.request_id in ids:
                    self._finish(group, SequenceStatus.FINISHED_ABORTED)
                    aborted.append(group)
                else:
                    kept.append(group)
            setattr(self, name, kept)
        return aborted

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- the step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.policy is SchedulingPolicy.PRIORITY:
            for name in ("waiting", "running", "swapped"):
                setattr(self, name, deque(sorted(getattr(self, name), key=_priority_key)))
        if self.chunked_prefill:
            self._schedule_mixed(out)
        else:
            # Swapped groups arrived before anything still waiting: no new prefills until they are back.
            if not self.swapped:
                self._schedule_prefills(out, self.max_num_batched_tokens)
            if not out.scheduled:
                preempted = self._schedule_decodes(out)
                if not preempted:
                    self._schedule_swapped(out, self.max_num_batched_tokens)
        now = time.monotonic()
        others = out.scheduled
        if out.steady is not None:  # the decodes, first in the step: scheduled before, their tokens counted once
            others = out.scheduled[len(out.steady.scheduled):]
            out.num_batched_tokens = out.steady.num_tokens
        for sg in others:
            if sg.group.metrics.first_scheduled_time is None:
                sg.group.metrics.first_scheduled_time = now
            out.num_batched_tokens += sg.num_tokens
        return out

    def _schedule_mixed(self, out: SchedulerOutput) -> None:
        """Chunked prefill: decodes, then started prompts' next chunks, then swapped groups, then new prompts."""
        if self.policy is SchedulingPolicy.PRIORITY and self.waiting and not self.swapped:
            self._preempt_for_priority(out)  # before anything of running is scheduled
        preempted = self._schedule_decodes(out)
        budget = self.max_num_batched_tokens - sum(sg.num_tokens for sg in out.scheduled)
        for group in self.running:
            if budget <= 0:
                break
            seq = _mid_prefill_seq(group)
            if seq is not None:
                budget -= self._schedule_chunk(group, seq, budget, out)
        if preempted:  # no blocks to spare this step: nothing comes back or starts
            return
        budget = self._schedule_swapped(out, budget)
        if not self.swapped:
            self._schedule_prefills(out, budget)

    def _schedule_chunk(self, group: SequenceGroup, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """The next chunk of a one-sequence group's prompt (its blocks were all allocated at admission); its size."""
        num_tokens = min(seq.num_uncomputed_tokens(), max(budget, 0))
        if num_tokens > 0:
            out.scheduled.append(ScheduledGroup(group, True, num_tokens, num_tokens == seq.num_uncomputed_tokens()))
            out.block_tables[seq.seq_id] = self.block_manager.block_tables[seq.seq_id]
        return num_tokens

    def _schedule_prefills(self, out: SchedulerOutput, token_budget: int) -> None:
        if not self.waiting:
            return
        if self.policy is SchedulingPolicy.PRIORITY and not self.chunked_prefill:  # (chunked: done before the decodes)
            self._preempt_for_priority(out)
        num_seqs = sum(group.get_max_num_running_seqs() for group in self.running)
        while self.waiting and token_budget > 0:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            status = self.block_manager.can_allocate(group)
            error = self._never_admissible(group, seqs, status)
            if error is not None:
                self._end_with_error(group, out, error)
                continue
            num_tokens = sum(seq.num_uncomputed_tokens() for seq in seqs)  # before prefix-cache hits
            group_seqs = group.get_max_num_running_seqs()
            # A one-sequence prompt may start with a chunk of what the budget has left (chunked prefill).
            chunkable = self.chunked_prefill and len(seqs) == 1
            if chunkable:
                too_long = False  # (token_budget > 0 here: at least one token of it runs)
            else:  # with chunked prefill, a recomputed group of several sequences may overrun the budget, alone
                too_long = num_tokens > token_budget and not (
                    self.chunked_prefill and not any(sg.is_prefill for sg in out.scheduled))
            if status is AllocStatus.LATER or too_long or num_seqs + group_seqs > self.max_num_seqs:
                break
            self.waiting.popleft()
            self.block_manager.allocate(group)
            if group.metrics.num_cached_tokens is None:
                group.metrics.num_cached_tokens = seqs[0].num_computed_tokens
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            self._steady = None
            num_tokens = sum(seq.num_uncomputed_tokens() for seq in seqs)  # after prefix-cache hits
            if chunkable:  # (rarely 0 after the hits: it then starts next step)
                num_tokens = self._schedule_chunk(group, seqs[0], token_budget, out)
            else:
                out.scheduled.append(ScheduledGroup(group, True, num_tokens))
                for seq in seqs:
                    out.block_tables[seq.seq_id] = self.block_manager.block_tables[seq.seq_id]
            token_budget -= num_tokens
            num_seqs += group_seqs

    def _never_admissible(self, group: SequenceGroup, seqs: list[Sequence], status: AllocStatus) -> Optional[str]:
        """Why the group could not be scheduled even alone in an empty engine, for the client; None if it can."""
        longest = max(seq.get_len() for seq in seqs)
        prompt_limit = self.max_model_len if self.chunked_prefill else min(self.max_model_len, self.max_num_batched_tokens)
        if longest > prompt_limit:
            return f"Input prompt ({longest} tokens) is too long and exceeds the limit of {prompt_limit} tokens."
        num_tokens = sum(seq.get_len() for seq in seqs)
        num_seqs = group.get_max_num_running_seqs()
        if (num_tokens > self.max_num_batched_tokens and not self.chunked_prefill) or num_seqs > self.max_num_seqs:
            # Only a group recomputing several sequences, or asking for more than max_num_seqs, gets here.
            return (f"The request needs {num_tokens} tokens in {num_seqs} sequences in one step, more than "
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) or --max-num-seqs "
                    f"({self.max_num_seqs}) allow.")
        if status is AllocStatus.NEVER:
            bm = self.block_manager
            needed = sum(bm.blocks_for(seq.get_len()) for seq in seqs)
            return (f"The request ({longest} tokens) needs {needed} KV cache blocks of {bm.block_size} tokens, but "
                    f"the cache has {bm.num_device_blocks} (less a watermark of {bm.watermark_blocks}): it can never "
                    "run. Give the KV cache more memory (--gpu-memory-utilization, --kv-cache-space).")
        return None

    def _schedule_decodes(self, out: SchedulerOutput) -> bool:
        """One more token for each running group, preempting the latest arrivals when blocks run out.

        The hot loop of every decode step: each group's running sequences are listed once.
        """
        bm = self.block_manager
        steady = self._steady
        if steady is not None and steady.armed and self._steady_decode(steady, out):
            return False
        self._steady = None
        preempted = False
        first = len(out.scheduled)
        queue, self.running = self.running, deque()
        while queue:
            group = queue.popleft()
            seqs = [seq for seq in group.seqs if seq.status is SequenceStatus.RUNNING]
            if not seqs and group.is_finished():
                self._finish(group, SequenceStatus.FINISHED_ABORTED)  # frees what the engine left; statuses stay
                continue
            if self.chunked_prefill and _is_mid_prefill(seqs):
                # Its next chunk comes from _schedule_mixed, after every decode.
                self.running.append(group)
                continue
            num_new_blocks = bm.num_append_blocks(seqs)
            while num_new_blocks and num_new_blocks > bm.get_num_free_device_blocks():
                victim = queue.pop() if queue else group
                self._preempt(victim, out)
                preempted = True
                if victim is group:
                    break
                num_new_blocks = bm.num_append_blocks(seqs)  # a victim may have shared a block with this group
            else:
                self._append_slots(group, seqs, out, grows=num_new_blocks > 0)
                self.running.append(group)
        if self._steady_allowed and not preempted and first == 0 and len(out.scheduled) == len(self.running):
            self._steady_version += 1
            self._steady = out.steady = SteadyDecode(self._steady_version, list(out.scheduled), bm.block_size,
                                                          bm.block_tables)
        return preempted

    def _steady_decode(self, steady: SteadyDecode, out: SchedulerOutput) -> bool:
        """The steady decode's next step: the same groups, new blocks for the rows entering one. False (nothing
        done) when the free blocks do not cover them: the step then lists the groups and preempts."""
        bm = self.block_manager
        due = steady.due()
        if len(due) > bm.get_num_free_device_blocks():
            return False
        rows = steady.rows
        for row in due:
            seq = rows[row][1]
            cow = bm.append_slots(seq)
            if cow is not None:  # (never: a decode writes into a block no one else holds; kept for safety)
                out.blocks_to_copy.append(cow)
        steady.steps += 1
        steady.armed = False
        out.scheduled.extend(steady.scheduled)
        out.block_tables.update(steady.block_tables)
        out.steady, out.steady_grown = steady, due
        return True

    def _schedule_swapped(self, out: SchedulerOutput, token_budget: int) -> int:
        """Swap groups back in while blocks, max_num_seqs and the token budget allow; returns the budget left."""
        if not self.swapped:
            return token_budget
        bm = self.block_manager
        num_seqs = sum(group.get_max_num_running_seqs() for group in self.running)
        while self.swapped:
            group = self.swapped[0]
            status = bm.can_swap_in(group)
            if status is AllocStatus.NEVER:
                needed = len(group.get_seqs(SequenceStatus.SWAPPED))
                self._end_with_error(group, out, f"The request was swapped out and its {needed} sequences no longer fit in the "
                             f"KV cache ({bm.num_device_blocks} blocks) to resume. Give the KV cache more memory "
                             "(--gpu-memory-utilization, --kv-cache-space) or ask for fewer sequences (n, best_of).",
                             queue=self.swapped, status=SequenceStatus.FINISHED_ERROR)
                continue
            group_seqs = group.get_max_num_running_seqs()
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            # A prompt swapped out between its chunks (--preemption-mode swap) resumes with a chunk of its own.
            mid_prefill = self.chunked_prefill and _is_mid_prefill(seqs)
            num_tokens = 1 if mid_prefill else sum(seq.num_uncomputed_tokens() for seq in seqs)
            if status is AllocStatus.LATER or num_seqs + group_seqs > self.max_num_seqs or num_tokens > token_budget:
                break
            self.swapped.popleft()
            self._steady = None
            bm.swap_in(group, out.blocks_to_swap_in)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            if mid_prefill:
                num_tokens = self._schedule_chunk(group, seqs[0], token_budget, out)
            else:
                self._append_slots(group, seqs, out)
            self.running.append(group)
            num_seqs += group_seqs
            token_budget -= num_tokens
        return token_budget

    def _append_slots(self, group: SequenceGroup, seqs: list[Sequence], out: SchedulerOutput,
                      grows: bool = True) -> None:
        """Schedule a decode of `seqs`, the group's RUNNING sequences, growing (or copying) their last blocks.

        `grows` False (num_append_blocks was 0): every next token has room in an unshared block, the
        common decode step, so the tables stay as they are.
        """
        bm = self.block_manager
        tables = bm.block_tables
        num_tokens = 0
        for seq in seqs:
            if grows:
                cow = bm.append_slots(seq)
                if cow is not None:
                    out.blocks_to_copy.append(cow)
            num_tokens += seq.get_len() - seq.num_computed_tokens
            out.block_tables[seq.seq_id] = tables[seq.seq_id]
        out.scheduled.append(ScheduledGroup(group, False, num_tokens))

    # -- preemption ----------------------------------------------------------------

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """A waiting group that does not fit pushes out running groups of strictly lower priority."""
        num_seqs = sum(group.get_max_num_running_seqs() for group in self.running)
        while self.running and self.running[-1].priority > self.waiting[0].priority:
            head = self.waiting[0]
            fits = self.block_manager.can_allocate(head) is not AllocStatus.LATER
            if fits and num_seqs + head.get_max_num_running_seqs() <= self.max_num_seqs:
                break
            victim = self.running.pop()
            num_seqs -= victim.get_max_num_running_seqs()
            self._preempt(victim, out)
            # A recompute victim went to the front; it must queue behind the groups that outrank it.
            self.waiting = deque(sorted(self.waiting, key=_priority_key))

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self._steady = None
        mode = self.preemption_mode
        if mode is None:
            # One sequence: recomputing its prompt is cheap. Several: their diverged outputs are worth keeping.
            mode = PreemptionMode.RECOMPUTE if group.get_max_num_running_seqs() == 1 else PreemptionMode.SWAP
        if any(seq.num_uncomputed_tokens() > 1 for seq in group.get_seqs(SequenceStatus.RUNNING)):
            # Still in its prompt (a chunked prefill, or scheduled and not yet run): no output to keep, and a
            # swapped-in group is scheduled as a decode, one token per sequence. Recompute, whatever the mode.
            mode = PreemptionMode.RECOMPUTE
        if mode is PreemptionMode.RECOMPUTE:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                self.block_manager.free(seq)
                seq.reset_for_recompute()
            # Victims leave latest-first, so pushing each to the front keeps waiting in arrival order.
            self.waiting.appendleft(group)
            out.num_preempted_recompute += 1
            return
        bm = self.block_manager
        if not bm.can_swap_out(group):
            # vLLM dies here; ending this one request keeps every other one served.
            self._finish(group, SequenceStatus.FINISHED_ERROR)
            group.error = (f"Out of host swap space: the request was preempted and its KV blocks do not fit in the "
                           f"{bm.get_num_free_cpu_blocks()} free swap blocks. Raise --swap-space.")
            out.ignored.append(group)
            return
        bm.swap_out(group, out.blocks_to_swap_out)
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.status = SequenceStatus.SWAPPED
        self.swapped.appendleft(group)
        out.num_preempted_swap += 1

    def _end_with_error(self, group: SequenceGroup, out: SchedulerOutput, error: str,
                        queue: deque | None = None, status: SequenceStatus | None = None) -> None:
        """End the group at the head of `queue` (default: waiting) with an error the client will read."""
        (self.waiting if queue is None else queue).popleft()
        if status is None:
            # A bare prompt was never admitted; a recomputed one had produced tokens already.
            has_output = any(seq.get_output_len() for seq in group.seqs)
            status = SequenceStatus.FINISHED_ERROR if has_output else SequenceStatus.FINISHED_IGNORED
        self._finish(group, status)
        group.error = error
        out.ignored.append(group)

    def _finish(self, group: SequenceGroup, status: SequenceStatus) -> None:
        for seq in group.seqs:
            if not seq.is_finished():
                seq.status = status
            self.block_manager.free(seq)

    def drop_steady(self) -> None:
        """The next decode lists the groups (a speculative step moved sequences by more than one token)."""
        self._steady = None

    # -- after the forward -----------------------------------------------------------

    def update_computed(self, out: SchedulerOutput) -> None:
        """Call right after the forward, before new tokens are appended: what ran now has K/V in the cache."""
        caching = self.block_manager.enable_prefix_caching
        scheduled_groups = out.scheduled
        steady = out.steady
        # A steady decode dropped since schedule() (a fork or free in between) may have rows it does not list:
        # then every group takes the listed path below.
        if steady is not None and steady is self._steady:
            self._update_steady(steady, caching)
            scheduled_groups = out.scheduled[len(steady.scheduled):]
        for scheduled in scheduled_groups:
            group = scheduled.group
            for seq in group.seqs:
                if seq.status is SequenceStatus.RUNNING:
                    seq.num_computed_tokens = scheduled.span_end(seq)
            if caching:
                self.block_manager.mark_blocks_as_computed(group)

    def _update_steady(self, steady: SteadyDecode, caching: bool) -> None:
        """The steady rows computed their one token each; a row that did not have exactly one (its sequence
        changed outside a step) drops the steady decode, so that the next step lists the groups again."""
        size = self.block_manager.block_size
        lockstep = True
        for group, seq in steady.rows:
            n = seq.get_len()
            if n - seq.num_computed_tokens != 1:
                lockstep = False
            seq.num_computed_tokens = n
            if caching and n % size == 0:  # a block filled up: it enters the prefix cache
                self.block_manager.mark_blocks_as_computed(group)
        steady.armed = lockstep and steady is self._steady
        if not lockstep:
            self._steady = None

    def apply(self, actions: BlockActions) -> None:
        """Forks first (a child may share a parent freed in the same step), then frees."""
        if actions.forks or actions.frees:
            self._steady = None
        for parent, child in actions.forks:
            self.block_manager.fork(parent, child)
        for seq in actions.frees:
            self.block_manager.free(seq)

    def free_finished_seq_groups(self, finished: Optional[list[SequenceGroup]] = None) -> None:
        """Drop finished groups from `running`; `finished`: the step's finished groups, when the caller knows
        them (an empty list costs nothing)."""
        if finished is not None and not finished:
            return
        before = len(self.running)
        self.running = deque(group for group in self.running if not group.is_finished())
        if len(self.running) != before:
            self._steady = None


def _is_mid_prefill(seqs: list[Sequence]) -> bool:
    """One sequence with more to compute than the token it sampled last: a prompt (or a sequence recomputed
    after preemption) between chunks. Its next step is a prefill chunk, however few tokens are left."""
    return len(seqs) == 1 and (seqs[0].num_uncomputed_tokens() > 1 or not seqs[0].output_token_ids)


def _mid_prefill_seq(group: SequenceGroup) -> Optional[Sequence]:
    """The group's one running sequence if it is a prompt between chunks."""
    seqs = [seq for seq in group.seqs if seq.status is SequenceStatus.RUNNING]
    return seqs[0] if _is_mid_prefill(seqs) else None


def _priority_key(group: SequenceGroup) -> tuple[int, float]:
    # Lower value first, as in vLLM; ties in arrival order.
    return (group.priority, group.arrival_time)
