"""Speculative decoding against llama.cpp's server (issue 56), over HTTP with one client, on one GGUF.

Four servers load the same GGUF side by side (llama-server with and without its n-gram speculation, pagedserve
with and without `--speculative-config`); each input-grounded task of benchmarks/data/spec_decode_tasks.json goes
to the four in turn (so a shared machine's load falls on all alike), one request at a time (C=1), greedy,
`max_tokens` 256, through /v1/chat/completions (each server renders the GGUF's own chat template). Reported per
server: output tokens / wall seconds summed over the tasks (prefill included, as spec_decode.py counts it), and
the speedup of each server's speculation over its own plain decoding and over llama.cpp's.

    .venv/bin/python benchmarks/spec_peers.py --gguf $LLAMA/model-bf16.gguf \
        --llama-server $LLAMA/build/bin/llama-server --json benchmarks/results/spec_peers.json

($LLAMA: the llama.cpp build and GGUFs benchmarks/peers.sh makes.)

llama.cpp's n-gram modes (`--spec-type`): ngram-simple with its defaults (lookup n-gram 12, draft 48) and one
tuned to prompt lookup as pagedserve does it (`--llama-ngram "ngram-simple --spec-ngram-simple-size-n 3
--spec-ngram-simple-size-m 8"`); the best of them is the peer.
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(label: str, cmd: list[str], port: int, logs: Path) -> subprocess.Popen:
    log = open(logs / f"spec_peers_{len(list(logs.glob('spec_peers_*.log')))}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"{label} exited: see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{label} did not answer /health")


def ask(port: int, task: dict, max_tokens: int) -> tuple[float, int, str, dict]:
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"{task['instruction']}\n\n{task['text']}"}]}
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=3600)
    seconds = time.perf_counter() - start
    r.raise_for_status()
    data = r.json()
    return seconds, data["usage"]["completion_tokens"], data["choices"][0]["message"]["content"], data.get("timings", {})


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` still stops the servers (the finally below)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--llama-server", required=True)
    p.add_argument("--llama-ngram", action="append", default=None,
                   help="a --spec-type value and its flags (repeatable); default: ngram-simple and a tuned one")
    p.add_argument("--dtype", default="bfloat16", help="pagedserve's --dtype")
    p.add_argument("--spec", default=NGRAM, help="pagedserve's --speculative-config")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--tasks", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1, help="passes over the tasks")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ngrams = args.llama_ngram or ["ngram-simple",
                                  "ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8"]
    t = str(args.threads)
    llama = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "-t", t, "-tb", t, "-np", "1", "-c", "4096"]
    ours = [sys.executable, "-m", "server.cli", "serve", args.gguf, "--dtype", args.dtype, "--disable-log-stats",
            "--max-model-len", "4096", "--kv-cache-space", "1", "--swap-space", "0.5"]
    servers = {"llama.cpp": llama}
    for spec in ngrams:
        servers[f"llama.cpp --spec-type {spec}"] = llama + ["--spec-type"] + shlex.split(spec)
    servers["pagedserve"] = ours
    servers["pagedserve ngram"] = ours + ["--speculative-config", args.spec]
    tasks = json.loads((ROOT / "benchmarks/data/spec_decode_tasks.json").read_text())["tasks"][: args.tasks]
    logs = Path(args.json).parent if args.json else ROOT / "benchmarks/results"
    logs.mkdir(parents=True, exist_ok=True)
    procs, ports = {}, {}
    totals = {label: [0.0, 0] for label in servers}
    outputs: dict[str, list[str]] = {label: [] for label in servers}
    try:
        for label, cmd in servers.items():
            ports[label] = free_port()
            procs[label] = start(label, cmd + ["--port", str(ports[label])], ports[label], logs)
            ask(ports[label], {"instruction": "Say hi.", "text": ""}, 8)  # warm-up
        for _ in range(args.rounds):
            for task in tasks:
                for label in servers:
                    seconds, tokens, text, timings = ask(ports[label], task, args.max_tokens)
                    totals[label][0] += seconds
                    totals[label][1] += tokens
                    outputs[label].append(text)
                    extra = {k: timings[k] for k in ("draft_n", "draft_n_accepted") if k in timings}
                    print(json.dumps({"server": label, "task": task.get("name"), "tokens": tokens,
                                      "tok_s": round(tokens / seconds, 2), **extra}), flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)
    tok_s = {label: n / s for label, (s, n) in totals.items()}
    best_llama = max(v for k, v in tok_s.items() if k.startswith("llama.cpp"))
    report = {"gguf": args.gguf, "dtype": args.dtype, "spec": json.loads(args.spec), "llama_ngram": ngrams,
              "cpu": cpu_name(), "tok_s": tok_s,
              "pagedserve_spec_over_plain": tok_s["pagedserve ngram"] / tok_s["pagedserve"],
              "pagedserve_spec_over_best_llama": tok_s["pagedserve ngram"] / best_llama,
              "identical_pagedserve": outputs["pagedserve"] == outputs["pagedserve ngram"]}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["identical_pagedserve"] else 1


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


if __name__ == "__main__":
    sys.exit(main())
