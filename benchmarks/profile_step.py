"""Where a decode step's time goes: scheduler, input prep, forward, sampling, output processing.

Builds the real LLMEngine, fills it with `--batch` requests (`--input-len` random
prompt tokens, EOS ignored), runs the prefills, then times `--steps` decode steps
of LLMEngine.step() with a timer around each stage (wrapped methods; the step
itself is unchanged). Optionally a torch.profiler table of the forward's ops.

    .venv/bin/python benchmarks/profile_step.py                       # batch 32, 128-token prompts
    .venv/bin/python benchmarks/profile_step.py --torch-profile       # plus the top ops (with --prefill too)
    .venv/bin/python benchmarks/profile_step.py --dtype bfloat16      # bf16 weights and activations
    .venv/bin/python benchmarks/profile_step.py --prefill             # one 128-token prefill (TTFT's forward)
    .venv/bin/python benchmarks/profile_step.py --batch 1 --compare-eager   # compiled decode step against eager
    .venv/bin/python benchmarks/profile_step.py --prefill --compare-eager   # the same for a 128-token prefill
    py-spy record -o step.svg -- .venv/bin/python benchmarks/profile_step.py --steps 200
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.platform.openmp import apply_serving_default  # noqa: E402  (no torch import)

apply_serving_default()  # as `pagedserve serve` does, before torch loads libgomp

import torch  # noqa: E402

# Stage -> the (object attribute path, method) pairs whose time it sums. "forward" is the model's
# forward and logits; "input prep" is ModelRunner.prepare; detokenization is inside output processing.
STAGES = ("scheduler", "cache ops", "input prep", "forward", "sampling", "output processing")


class StageTimer:
    """Wraps methods so that each call's wall time is added to its stage.

    Only calls on the thread that steps the engine count, and only the outermost one: a split decode step
    (ModelRunner._split_decode) counts once as "forward", not again for the shards' model calls inside it
    or on the shard threads."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.enabled = False
        self._thread = threading.get_ident()
        self._active = False

    def wrap(self, obj, name: str, stage: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            if not self.enabled or self._active or threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            self._active = True
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[stage] += time.perf_counter() - start
                self._active = False

        setattr(obj, name, timed)


# The compiled kernels of engine/ops/__init__.py are plain Python-bound calls, which torch.profiler does not see: without
# ranges of their own, --torch-profile listed only the aten glue between them (~5 % of a step).
PROFILED_OPS = ("small_gemm", "llama_decode_layers", "paged_attention", "prefill_attention", "reshape_and_cache",
                "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "argmax_logsumexp")


@contextlib.contextmanager
def ops_ranges():
    """Each engine.ops kernel call (PROFILED_OPS) as a torch.profiler range named ops.<name>, while inside.

    A compiled CPU step is one ops.llama_decode_layers range (its kernels are called from C++); --enforce-eager
    splits it into its kernels. The second shard of a split decode step runs on a thread the profiler does not
    record: a decode batch of 16 or more shows one shard's kernels (--threads 1 shows the whole step)."""
    from torch.profiler import record_function

    from engine import ops

    originals = {name: getattr(ops, name) for name in PROFILED_OPS}

    def ranged(name, fn):
        def call(*args, **kwargs):
            with record_function(f"ops.{name}"):
                return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(ops, name, ranged(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)


def instrument(engine, timer: StageTimer) -> None:
    timer.wrap(engine.scheduler, "schedule", "scheduler")
    timer.wrap(engine.scheduler, "update_computed", "scheduler")
    timer.wrap(engine.scheduler, "free_finished_seq_groups", "scheduler")
    timer.wrap(engine.cache_engine, "apply", "cache ops")
    timer.wrap(engine.model_runner, "prepare", "input prep")
    timer.wrap(engine.model_runner, "_split_decode", "forward")  # a decode batch split across the cores
    timer.wrap(engine.model_runner.model, "forward", "forward")
    timer.wrap(engine.model_runner.model, "compute_logits", "forward")
    # A greedy batch's head reduces its logits to argmax / logsumexp as it computes them (compute_greedy): that
    # reduction, the sampling stage's work before, is counted in the forward.
    timer.wrap(engine.model_runner.model, "compute_greedy", "forward")
    if engine.model_runner.graphs is not None:  # a CUDA decode step replays its graph (engine/worker/cuda_graphs.py)
        timer.wrap(engine.model_runner.graphs, "run", "forward")
    timer.wrap(engine.sampler, "sample", "sampling")
    timer.wrap(engine.sampler, "sample_rows", "sampling")
    timer.wrap(engine.output_processor, "process", "output processing")
    timer.wrap(engine.output_processor, "process_rows", "output processing")
    timer.wrap(engine.output_processor, "to_request_output", "output processing")


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 10000) for _ in range(length)] for _ in range(num)]


def profile_prefill(engine, timer: StageTimer, args) -> None:
    """Times one request's prefill (forward + last-token logits) at a time: the compute part of TTFT."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    model = engine.model_runner.model
    # --compare-eager: alternate the compiled step and the eager one prefill by prefill (a noisy neighbour hits both).
    modes = (True, False) if args.compare_eager else (model.compiled_decode,)
    forward_ms: dict[bool, list[float]] = {mode: [] for mode in modes}
    step_ms: dict[bool, list[float]] = {mode: [] for mode in modes}
    for i, prompt in enumerate(make_prompts(args.steps + 2, args.input_len, 1)):  # distinct prompts: no prefix hits
        mode = modes[i % len(modes)]
        model.compiled_decode = mode
        engine.add_request(f"p{i}", prompt_token_ids=prompt, params=params)
        timer.totals.clear()
        timer.enabled = i >= 2  # two warm-up prefills
        start = time.perf_counter()
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        if not any(o.finished and o.outputs and o.outputs[0].token_ids for o in outputs):
            raise SystemExit(f"prefill {i} produced no token: {outputs}")
        if timer.enabled:
            step_ms[mode].append((time.perf_counter() - start) * 1000)
            forward_ms[mode].append(timer.totals["forward"] * 1000)
        timer.enabled = False
    model.compiled_decode = modes[0]
    for mode in modes:
        forward, step = sorted(forward_ms[mode]), sorted(step_ms[mode])
        med = len(forward) // 2
        label = "" if len(modes) == 1 else (" compiled" if mode else " eager")
        print(f"prefill of {args.input_len} tokens{label}, dtype {engine.dtype}, {torch.get_num_threads()} torch "
              f"threads, {len(forward)} runs: forward median {forward[med]:.1f} ms (best {forward[0]:.1f}), "
              f"step median {step[med]:.1f} ms (best {step[0]:.1f})")
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with ops_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for i, prompt in enumerate(make_prompts(8, args.input_len, 2)):
                engine.add_request(f"q{i}", prompt_token_ids=prompt, params=params)
                while engine.has_unfinished_requests():
                    engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(
            {"mode": "prefill", "input_len": args.input_len, "dtype": str(engine.dtype),
             "threads": torch.get_num_threads(),
             **({"forward_ms": forward_ms[modes[0]], "step_ms": step_ms[modes[0]]} if len(modes) == 1 else
                {"compiled": {"forward_ms": forward_ms[True], "step_ms": step_ms[True]},
                 "eager": {"forward_ms": forward_ms[False], "step_ms": step_ms[False]}})}, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="decode steps timed (after 4 warm-up steps)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--torch-profile", action="store_true",
                   help="print the forward's top ops (torch.profiler; each compiled kernel call as an ops.<name> "
                        "range; with --enforce-eager the compiled step's kernels one by one)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--prefill", action="store_true",
                   help="time --steps single-sequence prefills of --input-len tokens instead of decode steps")
    p.add_argument("--enforce-eager", action="store_true", help="every step op by op (no compiled decode step)")
    p.add_argument("--quantization", default=None, choices=("int8", "fp8", "none"), help="as serve's flag")
    p.add_argument("--compare-eager", action="store_true",
                   help="A/B in one engine: --steps decode steps in chunks of 8 alternating the compiled step and "
                        "the eager one (with --prefill: prefill by prefill); prints each one's median step time")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    max_len = max(512, args.input_len + args.steps + 32)  # a prompt past max_model_len would be refused
    engine = LLMEngine(EngineConfig(model=args.model, max_model_len=max_len, kv_cache_space=0.5, swap_space=0.1,
                                    max_num_seqs=max(256, args.batch), dtype=args.dtype,
                                    quantization=args.quantization, enforce_eager=args.enforce_eager))
    gc.collect()
    gc.freeze()  # as `pagedserve serve` does after load: collections walk only what the steps make
    timer = StageTimer()
    instrument(engine, timer)
    if args.prefill:
        return profile_prefill(engine, timer, args)
    total_new = args.steps + 8 + (8 if args.torch_profile else 0)  # every profiled step still decodes
    params = SamplingParams(temperature=0.0, max_tokens=total_new, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(args.batch, args.input_len, 0)):
        engine.add_request(str(i), prompt_token_ids=prompt, params=params)
    while engine.scheduler.waiting or any(g.seqs[0].get_output_len() == 0 for g in engine.scheduler.running):
        engine.step()  # the prefills
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == args.batch, "every request must be decoding"
    if args.compare_eager:
        return compare_eager(engine, args)

    timer.enabled = True
    moe = moe_weight_bytes(engine.model_runner.model)
    if moe is not None:
        from engine import ops

        ops.moe_bytes_read(reset=True)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - start
    timer.enabled = False
    if moe is not None:
        report_moe_bytes(moe, ops.moe_bytes_read(reset=True) / args.steps, wall / args.steps, args.batch)

    step_ms = wall / args.steps * 1000
    rows = {stage: timer.totals[stage] / args.steps * 1000 for stage in STAGES}
    rows["other (step loop)"] = step_ms - sum(rows.values())
    overhead = sum(rows[s] for s in ("scheduler", "cache ops", "input prep", "sampling", "output processing"))
    overhead += rows["other (step loop)"]
    print(f"decode step at batch {args.batch} (context ~{args.input_len}), dtype {engine.dtype}, "
          f"{torch.get_num_threads()} torch threads: "
          f"{step_ms:.2f} ms/step, {args.batch / (step_ms / 1000):.0f} output tokens/s")
    for stage, ms in rows.items():
        print(f"  {stage:20s} {ms:7.2f} ms  {100 * ms / step_ms:5.1f} %")
    print(f"  {'non-forward total':20s} {overhead:7.2f} ms  {100 * overhead / step_ms:5.1f} %")

    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        on_cuda = engine.device.type == "cuda"  # then the kernels' device time, graph replays' kernels included
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with ops_ranges(), profile(activities=activities) as prof:
            for _ in range(8):
                engine.step()
        sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort_by, row_limit=25))

    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(
            {"batch": args.batch, "input_len": args.input_len, "threads": torch.get_num_threads(),
             "step_ms": step_ms, "stages_ms": rows, "non_forward_pct": 100 * overhead / step_ms}, indent=2))


def moe_weight_bytes(model) -> "dict | None":
    """A mixture of experts' weight bytes a decode step reads: every packed weight but the experts' (attention, dense
    MLPs, routers, the head), one expert's (gate | up and down), the sparse layers and their top-k; None for a dense
    model (or experts not packed)."""
    from engine.model_executor.layers.moe import MoEMLP

    sparse = [m for m in model.modules() if isinstance(m, MoEMLP) and m.packed is not None]
    if not sparse:
        return None
    dense = sum(m._small_weight.nbytes for m in model.modules()
                if getattr(m, "_small_weight", None) is not None and not isinstance(m, torch.nn.Embedding))
    expert = (sparse[0].packed[0][0].nbytes + sparse[0].packed[1][0].nbytes)
    return {"dense": dense, "expert": expert, "layers": len(sparse), "top_k": sparse[0].args.top_k}


def report_moe_bytes(moe: dict, expert_bytes_per_step: float, step_s: float, batch: int) -> None:
    """Bytes a decode step read per token (the dense weights once a step, the experts' as the fused op counted them)
    against the active parameters' bytes per token (the dense weights and top_k experts a layer)."""
    active = moe["dense"] + moe["layers"] * moe["top_k"] * moe["expert"]
    read = moe["dense"] + expert_bytes_per_step
    print(f"  weights read a step: {read / 2**20:.0f} MiB ({expert_bytes_per_step / 2**20:.0f} MiB of experts, "
          f"{expert_bytes_per_step / moe['expert'] / moe['layers']:.1f} experts a layer), "
          f"{read / step_s / 1e9:.1f} GB/s; "
          f"per token {read / batch / 2**20:.0f} MiB against the active parameters' {active / 2**20:.0f} MiB "
          f"({read / batch / active:.2f}x)")


def compare_eager(engine, args) -> None:
    """Median decode step time, compiled decode step against eager, chunks of 8 steps alternating in one engine."""
    model = engine.model_runner.model
    chunks: dict[bool, list[float]] = {True: [], False: []}
    for i in range(max(2, args.steps // 8)):
        compiled = i % 2 == 0
        model.compiled_decode = compiled
        start = time.perf_counter()
        for _ in range(8):
            engine.step()
        chunks[compiled].append((time.perf_counter() - start) / 8 * 1000)
    model.compiled_decode = True
    median = {mode: sorted(v)[len(v) // 2] for mode, v in chunks.items()}
    print(f"decode step at batch {args.batch}, dtype {engine.dtype}, {torch.get_num_threads()} torch threads: "
          f"compiled {median[True]:.2f} ms, eager {median[False]:.2f} ms "
          f"(eager / compiled {median[False] / median[True]:.2f}), medians of {len(chunks[True])} chunks of 8 steps")
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(
            {"batch": args.batch, "input_len": args.input_len, "dtype": str(engine.dtype),
             "threads": torch.get_num_threads(), "compiled_step_ms": median[True], "eager_step_ms": median[False],
             "chunks_ms": {"compiled": chunks[True], "eager": chunks[False]}}, indent=2))


if __name__ == "__main__":
    main()
