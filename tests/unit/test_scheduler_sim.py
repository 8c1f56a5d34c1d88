"""The scheduler and block manager driven like the engine drives them, over a cache that holds token fingerprints.

Each cache slot stores a fingerprint of the tokens up to and including its
position (what real K/V depend on). The cache applies the scheduler's swap and
copy mappings exactly as the cache engine must; every forward writes the new
slots, then reads back every slot of every running sequence and checks it. The
next token is a function of what was read, so a wrong block table, a missed
copy-on-write, a bad swap or a stale prefix-cache hit changes the output. The
outputs must not depend on cache size, preemption mode or prefix caching.
Under a sliding window a forward reads only the slots its queries see, and the
block manager releases the blocks before them: a block released too early, or
reused while still seen, reads back a wrong fingerprint.
"""
from collections import Counter
from typing import NamedTuple, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.core.scheduler import BlockActions, Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 8
VOCAB = 3  # tiny, so prompts and outputs share prefixes and the prefix cache gets hits


class Request(NamedTuple):
    prompt: tuple[int, ...]
    best_of: int
    max_tokens: int
    priority: int = 0


def fingerprint(token_ids: list[int]) -> int:
    return hash(tuple(token_ids))


def next_token(read_last: int, sample_index: int) -> int:
    return hash((read_last, sample_index)) % VOCAB


class FingerprintCache:
    """Stands in for the K/V tensors of the device cache and the host swap pool."""

    def __init__(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.gpu: list[list[Optional[int]]] = [[None] * BS for _ in range(num_device_blocks)]
        self.cpu: list[list[Optional[int]]] = [[None] * BS for _ in range(num_cpu_blocks)]

    def apply(self, out: SchedulerOutput) -> None:
        for device_block, cpu_block in out.blocks_to_swap_out.items():
            self.cpu[cpu_block] = list(self.gpu[device_block])
        for cpu_block, device_block in out.blocks_to_swap_in.items():
            self.gpu[device_block] = list(self.cpu[cpu_block])
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])

    def forward(self, out: SchedulerOutput, sliding_window: Optional[int] = None) -> dict[int, int]:
        """Write the computed slots of every running sequence, then read all its slots: seq_id -> last slot read.

        A prompt chunk (do_sample False) writes and reads only up to the chunk's end; under a sliding window the
        reads start where the step's first query's window does."""
        running = [(seq, sg.span_end(seq))
                   for sg in out.scheduled for seq in sg.group.get_seqs(SequenceStatus.RUNNING)]
        for seq, end in running:
            table, tokens = out.block_tables[seq.seq_id], seq.all_token_ids
            assert seq.num_computed_tokens < end, "a scheduled sequence must compute something"
            for pos in range(seq.num_computed_tokens, end):
                self.gpu[table[pos // BS]][pos % BS] = fingerprint(tokens[:pos + 1])
        last_read = {}
        for seq, end in running:
            table, tokens = out.block_tables[seq.seq_id], seq.all_token_ids
            first = 0 if sliding_window is None else max(0, seq.num_computed_tokens - sliding_window + 1)
            read = [self.gpu[table[pos // BS]][pos % BS] for pos in range(first, end)]
            assert read == [fingerprint(tokens[:pos + 1]) for pos in range(first, end)], f"{seq} read wrong K/V"
            last_read[seq.seq_id] = read[-1]
        return last_read


def check_ref_counts(sched: Scheduler) -> None:
    bm = sched.block_manager
    for tables, alloc in ((bm.block_tables, bm.gpu), (bm.cpu_block_tables, bm.cpu)):
        uses = Counter(b for seq_id, table in tables.items() for b in table[bm.num_released(seq_id):])
        assert all(alloc.ref_count(b) == uses[b] for b in range(alloc.num_blocks))
        assert alloc.num_free() == alloc.num_blocks - len(uses)


def simulate(requests: list[Request], num_device_blocks: int, num_cpu_blocks: int = 64, abort_at: Optional[dict] = None,
             sliding_window: Optional[int] = None, **overrides) -> tuple[dict[str, object], Counter]:
    """Run to completion; returns request_id -> sorted output token tuples (or the error), and event counts."""
    fields = dict(block_size=BS, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8, watermark=0.0)
    fields.update(overrides)
    config = EngineConfig(**fields)
    config.resolve(64)
    sched = Scheduler(config, num_device_blocks, num_cpu_blocks, sliding_window=sliding_window)
    cache = FingerprintCache(num_device_blocks, num_cpu_blocks)
    seq_ids = iter(range(10**6))
    groups = []
    for i, req in enumerate(requests):
        params = SamplingParams(best_of=req.best_of, max_tokens=req.max_tokens, temperature=1.0)
        group = SequenceGroup(f"r{i}", [Sequence(next(seq_ids), list(req.prompt))], params, arrival_time=float(i),
                              priority=req.priority)
        groups.append(group)
        sched.add_seq_group(group)
    events: Counter = Counter()
    for step in range(2000):
        if not sched.has_unfinished_seqs():
            break
        for request_id in (abort_at or {}).get(step, ()):
            events["aborted"] += len(sched.abort_seq_group(request_id))
        out = sched.schedule()
        check_ref_counts(sched)
        events["recompute"] += out.num_preempted_recompute
        events["swap"] += out.num_preempted_swap
        events["batched_tokens"] += out.num_batched_tokens
        if config.enable_chunked_prefill:
            events["mixed"] += any(sg.is_prefill for sg in out.scheduled) and not all(sg.is_prefill for sg in out.scheduled)
            events["chunks"] += sum(not sg.do_sample for sg in out.scheduled)
            events["over_budget"] += out.num_batched_tokens > config.max_num_batched_tokens
        else:
            assert out.num_batched_tokens <= config.max_num_batched_tokens
        cache.apply(out)
        events["peak_blocks"] = max(events["peak_blocks"], num_device_blocks - sched.block_manager.get_num_free_device_blocks())
        last_read = cache.forward(out, sliding_window)
        sched.update_computed(out)
        for scheduled in out.scheduled:
            if scheduled.do_sample:
                _sample(sched, scheduled.group, last_read, seq_ids)
        sched.free_finished_seq_groups()
        check_ref_counts(sched)
    else:
        raise AssertionError("the scheduler never finished the workload")
    bm = sched.block_manager
    assert bm.get_num_free_device_blocks() == num_device_blocks and bm.get_num_free_cpu_blocks() == num_cpu_blocks
    assert not bm.block_tables and not bm.cpu_block_tables
    results = {}
    for group in groups:
        assert group.is_finished()
        if group.error or group.seqs[0].status is SequenceStatus.FINISHED_ABORTED:
            results[group.request_id] = group.error or "aborted"
        else:
            # No silent incomplete output: every sequence ran to max_tokens.
            assert all(seq.get_output_len() == group.sampling_params.max_tokens for seq in group.seqs)
            results[group.request_id] = sorted(tuple(seq.output_token_ids) for seq in group.seqs)
    return results, events


def _sample(sched: Scheduler, group: SequenceGroup, last_read: dict[int, int], seq_ids) -> None:
    """The engine's part: fork best_of samples after the prompt, append a token, stop at max_tokens."""
    running = group.get_seqs(SequenceStatus.RUNNING)
    params = group.sampling_params
    if len(group.seqs) == 1 and running[0].get_output_len() == 0 and params.best_of > 1:
        parent = running[0]
        for index in range(1, params.best_of):
            child = parent.fork(next(seq_ids))
            group.add(child)
            sched.apply(BlockActions(forks=[(parent, child)]))
            token = next_token(last_read[parent.seq_id], index)
            child.append_token(token, {token: 0.0})
    for seq in running:
        token = next_token(last_read[seq.seq_id], 0)
        seq.append_token(token, {token: 0.0})
    for seq in group.get_seqs(SequenceStatus.RUNNING):
        if seq.get_output_len() >= params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            sched.apply(BlockActions(frees=[seq]))


SHARED = (0, 1, 2) * 6  # two full blocks and a bit
WORKLOAD = [
    Request(SHARED + (1,), 1, 8), Request(SHARED + (2, 2), 3, 6), Request((2,) * 7, 1, 10),
    Request(SHARED, 2, 9), Request(SHARED + (1,), 1, 8), Request((1, 0, 1), 1, 12),
    Request(SHARED + (0, 0, 0, 1), 2, 5), Request((0,), 1, 7),
]


def test_outputs_do_not_depend_on_cache_size_preemption_or_prefix_caching():
    reference, events = simulate(WORKLOAD, num_device_blocks=200)
    assert events["recompute"] == events["swap"] == 0
    assert all(isinstance(r, list) for r in reference.values())
    preempted = Counter()
    for mode in (None, "recompute", "swap"):
        for caching in (False, True):
            results, events = simulate(WORKLOAD, num_device_blocks=12, preemption_mode=mode, enable_prefix_caching=caching)
            assert results == reference, (mode, caching)
            preempted[mode] += events["recompute"] + events["swap"]
    assert all(preempted[mode] > 0 for mode in (None, "recompute", "swap"))
    results, _ = simulate(WORKLOAD, num_device_blocks=200, enable_prefix_caching=True)
    assert results == reference


def test_prefix_caching_reduces_computed_tokens():
    plain, plain_events = simulate(WORKLOAD, num_device_blocks=200)
    cached, cached_events = simulate(WORKLOAD, num_device_blocks=200, enable_prefix_caching=True)
    assert cached == plain
    # r0..r3 fill the first 64-token prefill batch; r4 and r6 then find SHARED's two full blocks cached.
    assert cached_events["batched_tokens"] <= plain_events["batched_tokens"] - 2 * 2 * BS


def test_aborts_mid_run_free_everything_and_spare_the_rest():
    reference, _ = simulate(WORKLOAD, num_device_blocks=200)
    results, events = simulate(WORKLOAD, num_device_blocks=12, num_cpu_blocks=64, abort_at={2: ["r1", "r6"], 5: ["r7"]})
    assert events["aborted"] == 3
    assert results["r1"] == results["r6"] == results["r7"] == "aborted"
    assert {k: v for k, v in results.items() if v != "aborted"} == {
        k: v for k, v in reference.items() if k not in ("r1", "r6", "r7")}


def test_small_swap_space_ends_only_the_groups_that_do_not_fit():
    reference, _ = simulate(WORKLOAD, num_device_blocks=200)
    results, _ = simulate(WORKLOAD, num_device_blocks=12, num_cpu_blocks=2)
    errors = {k: v for k, v in results.items() if isinstance(v, str)}
    assert errors and all("--swap-space" in v for v in errors.values())
    assert all(results[k] == reference[k] for k in results if k not in errors)


requests_strategy = st.lists(
    st.builds(Request, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20).map(tuple),
              st.integers(1, 3), st.integers(1, 10), st.integers(0, 2)),
    min_size=1, max_size=7)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_strategy, num_device_blocks=st.integers(4, 16), num_cpu_blocks=st.integers(0, 24),
       mode=st.sampled_from([None, "recompute", "swap"]), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_workloads_match_the_unpreempted_run_or_fail_cleanly(requests, num_device_blocks, num_cpu_blocks, mode,
                                                                      caching, policy):
    reference, _ = simulate(requests, num_device_blocks=400)
    results, _ = simulate(requests, num_device_blocks, num_cpu_blocks, preemption_mode=mode,
                          enable_prefix_caching=caching, scheduling_policy=policy)
    for request_id, result in results.items():
        # A request either produces exactly the unpreempted output or ends with an error naming its cause.
        assert result == reference[request_id] or (isinstance(result, str) and "--" in result), result


def test_prefix_block_shared_by_two_groups_swapped_out_in_one_step():
    """r1 and r2 share a prefix-cached block; both are swapped out in one step, then resume with the right K/V.

    A {gpu: cpu} mapping holds one destination per block, so the second group must reuse the first's cpu copy.
    """
    requests = [Request((0,), 1, 2), Request((0, 0, 0, 0, 0, 2, 0, 0, 0), 2, 2), Request((0, 0, 0, 0, 0, 2, 0, 0, 0), 2, 2)]
    reference, _ = simulate(requests, num_device_blocks=400)
    results, events = simulate(requests, num_device_blocks=4, num_cpu_blocks=4, enable_prefix_caching=True)
    assert events["swap"] == 2 and results == reference


def test_chunked_prefill_keeps_the_outputs():
    """Chunks of 8 or 16 tokens mixed with decodes: the same outputs under any cache size, mode or caching."""
    reference, _ = simulate(WORKLOAD, num_device_blocks=200)
    for budget in (8, 16):
        for mode in (None, "recompute", "swap"):
            for caching in (False, True):
                for blocks in (200, 12):
                    results, events = simulate(WORKLOAD, num_device_blocks=blocks, enable_chunked_prefill=True,
                                               max_num_batched_tokens=budget, preemption_mode=mode,
                                               enable_prefix_caching=caching)
                    assert results == reference, (budget, mode, caching, blocks)
                    assert events["mixed"] > 0 and events["chunks"] > 0
                    # Over the budget only to recompute a group of several sequences in one step.
                    assert events["over_budget"] == 0 or events["recompute"] > 0


@pytest.mark.parametrize("window", [3, 8, 13])
def test_sliding_window_releases_blocks_and_keeps_the_outputs(window):
    """Blocks behind the window go back to the pool, yet every slot a query sees reads back right: under
    preemption of both kinds, prefix caching, chunked prefill and forks (best_of)."""
    reference, plain = simulate(WORKLOAD, num_device_blocks=200)
    results, windowed = simulate(WORKLOAD, num_device_blocks=200, sliding_window=window)
    assert results == reference
    assert windowed["peak_blocks"] < plain["peak_blocks"]
    for mode in (None, "recompute", "swap"):
        for caching in (False, True):
            for chunked in ({}, dict(enable_chunked_prefill=True, max_num_batched_tokens=16)):
                results, _ = simulate(WORKLOAD, num_device_blocks=12, preemption_mode=mode, enable_prefix_caching=caching,
                                      sliding_window=window, **chunked)
                assert results == reference, (mode, caching, chunked)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_strategy, num_device_blocks=st.integers(4, 16), num_cpu_blocks=st.integers(0, 24),
       mode=st.sampled_from([None, "recompute", "swap"]), caching=st.booleans(), window=st.integers(1, 20),
       chunk=st.sampled_from([None, 8, 16]))
def test_random_workloads_under_a_sliding_window(requests, num_device_blocks, num_cpu_blocks, mode, caching, window,
                                                 chunk):
    reference, _ = simulate(requests, num_device_blocks=400)
    chunked = {} if chunk is None else dict(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    results, _ = simulate(requests, num_device_blocks, num_cpu_blocks, preemption_mode=mode,
                          enable_prefix_caching=caching, sliding_window=window, **chunked)
    for request_id, result in results.items():
        assert result == reference[request_id] or (isinstance(result, str) and "--" in result), result
