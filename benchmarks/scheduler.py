"""Cost of one Scheduler.schedule() call: 256 running groups decoding, 16-token blocks; prefill admission; and
the prefix cache's chained sha256 per full block (against Python's hash(), which it replaced).

Pure Python, no model: the engine runs schedule() before every forward, so its
cost is paid thousands of times a minute. Timings exclude the simulated model
step (update_computed + one appended token per sequence), which is reported
apart. Wall-clock figures include time the process waited for a core on a busy
machine; the cpu_* figures (this thread's CPU time) do not. Prints a table and writes JSON (benchmarks/results/scheduler.json).

    .venv/bin/python benchmarks/scheduler.py
    .venv/bin/python benchmarks/scheduler.py --num-groups 512 --steps 2000 --prefix-caching
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.core.block_allocator import NO_PREFIX_HASH, hash_block  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.sequence import Sequence, SequenceGroup, SequenceStatus  # noqa: E402


def make_scheduler(args, num_device_blocks: int) -> Scheduler:
    config = EngineConfig(block_size=args.block_size, max_model_len=4096, max_num_seqs=args.num_groups,
                          max_num_batched_tokens=max(4096, args.num_groups * args.prompt_len),
                          enable_prefix_caching=args.prefix_caching)
    config.resolve(4096)
    return Scheduler(config, num_device_blocks, num_cpu_blocks=0)


def make_groups(args, first_id: int = 0) -> list[SequenceGroup]:
    params = SamplingParams(temperature=1.0, max_tokens=args.steps + 1)
    # Distinct prompts: the prefix cache (when on) finds nothing to share, the worst case for its bookkeeping.
    return [SequenceGroup(f"r{i}", [Sequence(i, [i] * args.prompt_len)], params, arrival_time=float(i))
            for i in range(first_id, first_id + args.num_groups)]


def summarize(samples_ns: list[int], cpu_ns: list[int]) -> dict:
    us = sorted(ns / 1000 for ns in samples_ns)
    cpu = sorted(ns / 1000 for ns in cpu_ns)
    return {
        "calls": len(us),
        "median_us": round(statistics.median(us), 2),
        "mean_us": round(statistics.fmean(us), 2),
        "p99_us": round(us[min(len(us) - 1, int(0.99 * len(us)))], 2),
        "max_us": round(us[-1], 2),
        "cpu_median_us": round(statistics.median(cpu), 2),
        "cpu_p99_us": round(cpu[min(len(cpu) - 1, int(0.99 * len(cpu)))], 2),
    }


def bench_decode(args) -> tuple[dict, dict]:
    """schedule() with num_groups RUNNING single-sequence groups, one decode token each, for many steps."""
    blocks_per_seq = -(-(args.prompt_len + args.steps + args.warmup + 1) // args.block_size)
    sched = make_scheduler(args, num_device_blocks=args.num_groups * blocks_per_seq)
    for group in make_groups(args):
        sched.add_seq_group(group)
    schedule_ns, schedule_cpu_ns, step_ns, step_cpu_ns = [], [], [], []
    for step in range(args.warmup + args.steps + 1):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        out = sched.schedule()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        sched.update_computed(out)
        for scheduled in out.scheduled:
            for seq in scheduled.group.get_seqs(SequenceStatus.RUNNING):
                seq.append_token(7, {7: 0.0})
        t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        if step == 0:
            assert all(s.is_prefill for s in out.scheduled) and len(out.scheduled) == args.num_groups
        elif step > args.warmup:
            assert len(out.scheduled) == args.num_groups and not out.num_preempted_recompute
            schedule_ns.append(t1 - t0)
            schedule_cpu_ns.append(c1 - c0)
            step_ns.append(t2 - t1)
            step_cpu_ns.append(c2 - c1)
    return summarize(schedule_ns, schedule_cpu_ns), summarize(step_ns, step_cpu_ns)


def bench_prefill(args) -> dict:
    """One schedule() call that admits num_groups waiting prompts into an empty cache."""
    blocks_per_seq = -(-args.prompt_len // args.block_size) + 1
    samples, cpu_samples = [], []
    for rep in range(args.prefill_reps):
        sched = make_scheduler(args, num_device_blocks=args.num_groups * blocks_per_seq)
        for group in make_groups(args):
            sched.add_seq_group(group)
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        out = sched.schedule()
        samples.append(time.perf_counter_ns() - t0)
        cpu_samples.append(time.thread_time_ns() - c0)
        assert len(out.scheduled) == args.num_groups and all(s.is_prefill for s in out.scheduled)
    return summarize(samples, cpu_samples)


def bench_block_hash(args, num_blocks: int = 20000) -> dict:
    """hash_block() per full block (what admission and registration pay for each block with prefix caching
    on), against the builtin hash() of (parent, tokens) it replaced; ns per block."""
    blocks = [tuple(range(i, i + args.block_size)) for i in range(num_blocks)]
    result = {}
    for name, fn in (("sha256", hash_block), ("builtin_hash", lambda parent, tokens: hash((parent, tokens)))):
        best = None
        for _ in range(5):
            parent = NO_PREFIX_HASH if name == "sha256" else 0
            t0 = time.perf_counter_ns()
            for tokens in blocks:
                parent = fn(parent, tokens)
            elapsed = (time.perf_counter_ns() - t0) / num_blocks
            best = elapsed if best is None else min(best, elapsed)
        result[f"{name}_ns_per_block"] = round(best, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-groups", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2000, help="timed decode calls")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--prefill-reps", type=int, default=100)
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scheduler.json"))
    args = parser.parse_args()

    decode, model_step = bench_decode(args)
    prefill = bench_prefill(args)
    block_hash = bench_block_hash(args)
    result = {
        "benchmark": "scheduler.schedule()",
        "num_groups": args.num_groups, "block_size": args.block_size, "prompt_len": args.prompt_len,
        "prefix_caching": args.prefix_caching,
        "decode_schedule": decode,
        "prefill_admission_schedule": prefill,
        "simulated_model_step": model_step,  # update_computed + append_token, not part of schedule()
        "block_hash": block_hash,
        "load_average_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
    }
    print(f"schedule() with {args.num_groups} groups, {args.block_size}-token blocks, "
          f"prefix caching {'on' if args.prefix_caching else 'off'}")
    print(f"{'case':<26}{'calls':>7}{'median us':>12}{'p99 us':>10}{'max us':>10}{'cpu med us':>12}{'cpu p99 us':>12}")
    for name, row in (("decode (256 running)", decode), ("prefill admission", prefill),
                      ("update+append (not timed)", model_step)):
        print(f"{name:<26}{row['calls']:>7}{row['median_us']:>12}{row['p99_us']:>10}{row['max_us']:>10}"
              f"{row['cpu_median_us']:>12}{row['cpu_p99_us']:>12}")
    print(f"prefix-cache hash of one {args.block_size}-token block (best of 5): sha256 "
          f"{block_hash['sha256_ns_per_block']} ns, builtin hash() {block_hash['builtin_hash_ns_per_block']} ns")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
