"""Does tensor parallelism pay on this machine? TP=1 against TP=2, served, and the collectives' own cost.

1. Collectives: two gloo ranks (spawned processes, the cores split between them as the engine splits them)
   time the all-reduce of a [rows, hidden] float32 activation and the logits gather of [rows, vocab / 2], at
   the row counts of a decode step (1, 8, 32) and of a prompt chunk (512). A step of the Llama family runs
   2 * layers + 1 all-reduces (o_proj and down_proj of each layer, the vocab-parallel embedding) and one
   gather, after one broadcast of the step's input (timed too): their sum is the step's communication cost.
2. Served: `pagedserve serve --tensor-parallel-size N` for N = 1, 2 on the same random-weight model, then
   benchmarks/serving.py at each concurrency of --sweep (N = max(4, 2C) requests, 128 prompt and 128 output
   tokens, EOS ignored): output tok/s, TTFT and ITL.

The model is SmolLM2-135M's shape with 8 heads of 72 (2 key/value heads) instead of 9 of 64 (3 key/value
heads), which 2 does not divide: same hidden size, layers, MLP and vocabulary, about the same weight bytes.

    .venv/bin/python benchmarks/tensor_parallel.py                  # collectives + served, C = 1 and 32
    .venv/bin/python benchmarks/tensor_parallel.py --parts collectives
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=576, num_attention_heads=8, num_key_value_heads=2, head_dim=72, intermediate_size=1536,
             num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)
ROWS = (1, 8, 32, 512)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


# ---- 1. collectives ---------------------------------------------------------------------------------------------
def _rank(rank: int, port: int, min_time: float, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    hidden, vocab = SHAPE["hidden_size"], SHAPE["vocab_size"]
    results = {}
    for rows in ROWS:
        x = torch.randn(rows, hidden)
        logits = torch.randn(rows, vocab // 2)
        parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
        for name, op in (("all_reduce", lambda: dist.all_reduce(x)),
                         ("gather_logits", lambda: dist.gather(logits, parts, dst=0))):
            t0 = time.perf_counter()
            for _ in range(10):
                op()
            # Both ranks must run the same count: rank 0's estimate from the warm-up decides it.
            n = torch.tensor([max(10, int(min_time / ((time.perf_counter() - t0) / 10)))])
            dist.broadcast(n, src=0)
            t0 = time.perf_counter()
            for _ in range(int(n.item())):
                op()
            results[f"{name}/{rows}"] = (time.perf_counter() - t0) / int(n.item())
        payload = {"inp": list(range(rows)), "tables": [[0] * 8] * rows}  # about a decode step's broadcast
        t0 = time.perf_counter()
        for _ in range(20):
            dist.broadcast_object_list([payload if rank == 0 else None], src=0)
        results[f"broadcast_step/{rows}"] = (time.perf_counter() - t0) / 20
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def collectives(min_time: float) -> dict:
    import multiprocessing

    from engine.distributed.group import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, min_time, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join()
    layers = SHAPE["num_hidden_layers"]
    table = {}
    for rows in ROWS:
        ar, gather = results[f"all_reduce/{rows}"], results[f"gather_logits/{rows}"]
        bcast = results[f"broadcast_step/{rows}"]
        table[rows] = {"all_reduce_us": ar * 1e6, "gather_logits_us": gather * 1e6, "broadcast_step_us": bcast * 1e6,
                       "per_step_ms": ((2 * layers + 1) * ar + gather + bcast) * 1e3}
        print(f"rows {rows:4d}: all-reduce [{rows}, {SHAPE['hidden_size']}] {ar * 1e6:7.1f} us, logits gather "
              f"[{rows}, {SHAPE['vocab_size'] // 2}] x2 {gather * 1e6:8.1f} us, step broadcast {bcast * 1e6:7.1f} us;"
              f" per step ({2 * layers + 1} all-reduces + 1 gather + 1 broadcast) {table[rows]['per_step_ms']:.2f} ms")
    return table


# ---- 2. served ----------------------------------------------------------------------------------------------------
def model_folder() -> Path:
    """A config + tokenizer folder of SHAPE (weights: --load-format dummy), under $PAGEDSERVE_CACHE."""
    from transformers import LlamaConfig

    from engine.model_executor.loader import cache_dir, default_model_path

    folder = cache_dir() / "bench" / "smollm2-shaped-tp2"
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        source = default_model_path()
        LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2).save_pretrained(str(folder))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (source / name).exists():
                (folder / name).write_bytes((source / name).read_bytes())
    return folder


def served(tp: int, sweep: str, out_dir: Path) -> dict:
    from engine.distributed.group import free_port

    port = free_port()
    log = out_dir / f"server_tp{tp}.log"
    cmd = [sys.executable, "-m", "server.cli", "serve", str(model_folder()), "--load-format", "dummy",
           "--port", str(port), "--tensor-parallel-size", str(tp), "--max-model-len", "1024",
           "--kv-cache-space", "1", "--swap-space", "0.5", "--disable-log-stats"]
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        import httpx

        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the TP={tp} server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.5)
        out_json = out_dir / f"serving_tp{tp}.json"
        subprocess.run([sys.executable, "benchmarks/serving.py", "--base-url", base, "--label", f"TP={tp}",
                        "--sweep", sweep, "--rounds", "2", "--num-prompts-min", "4", "--strict",
                        "--output-json", str(out_json)], cwd=ROOT, check=True)
        return json.loads(out_json.read_text())
    finally:
        server.terminate()
        server.wait(60)


def compare(served_runs: dict) -> list[dict]:
    """Per concurrency: output tok/s, TTFT p50 and ITL p50 of TP=1 and TP=2, and TP=2's throughput ratio."""
    rows = []
    for one, two in zip(served_runs["tp1"]["runs"], served_runs["tp2"]["runs"]):
        row = {"concurrency": one["concurrency"], "ratio": two["output_throughput"] / one["output_throughput"]}
        for tp, run in (("tp1", one), ("tp2", two)):
            row[tp] = {"tok_s": run["output_throughput"], "ttft_p50_ms": run["ttft_ms"]["p50"],
                       "itl_p50_ms": run["itl_ms"]["p50"]}
        rows.append(row)
        print(f"C={row['concurrency']:3d}: TP=1 {row['tp1']['tok_s']:6.1f} tok/s (ITL p50 "
              f"{row['tp1']['itl_p50_ms']:.1f} ms), TP=2 {row['tp2']['tok_s']:6.1f} tok/s (ITL p50 "
              f"{row['tp2']['itl_p50_ms']:.1f} ms): TP=2 / TP=1 = {row['ratio']:.2f}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="collectives,served")
    parser.add_argument("--sweep", default="1,32")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds per collective timing")
    parser.add_argument("--output-json", default="benchmarks/results/tensor_parallel.json")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    report = {"cpu": f"{cpu_name()} ({cpu_flags()}), {len(os.sched_getaffinity(0))} cores", "shape": SHAPE}
    print(f"CPU: {report['cpu']}")
    if "collectives" in parts:
        report["collectives"] = collectives(args.min_time)
    if "served" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            report["served"] = {f"tp{tp}": served(tp, args.sweep, Path(tmp)) for tp in (1, 2)}
        report["comparison"] = compare(report["served"])
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
