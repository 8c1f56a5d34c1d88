#!/usr/bin/env python
"""Soak test: N minutes of mixed traffic against a pagedserve server, sampling its RSS and KV cache usage.

    python scripts/soak.py                                  # start `pagedserve serve` (default model), 10 min
    python scripts/soak.py --model /path/to/hf --duration-s 60
    python scripts/soak.py --url http://127.0.0.1:8000 --pid 1234   # a running server (pid: for its RSS)

Traffic: streamed and non-streamed completions, chat, n=2, best_of=2, clients that disconnect mid-stream,
and malformed bodies. After the warm-up, neither the server's RSS nor its KV usage may grow: the report
gives the drift (median of the second half of the post-warm-up samples minus median of the first half,
robust to the allocator's sawtooth) and the least-squares RSS slope, and the exit status is 1 when a
threshold is passed, a request got a 5xx, a token count was wrong, or the KV cache was not empty once the
traffic stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_SERVER_ARGS = "--max-model-len 256 --num-gpu-blocks-override 96 --max-num-seqs 16 --disable-log-stats"
GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "num_requests_swapped")


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The flags that pick the server under soak (see soak_server)."""
    p.add_argument("--url", help="a running server; default: start one")
    p.add_argument("--pid", type=int, help="the running server's pid, for its RSS (with --url)")
    p.add_argument("--model", default=None, help="model for the server this script starts (default model if omitted)")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="extra `pagedserve serve` flags")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--warmup-s", type=float, default=None, help="default: 20%% of the duration")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sample-interval-s", type=float, default=1.0)
    p.add_argument("--max-rss-drift-mib", type=float, default=8.0,
                   help="RSS growth after warm-up allowed: the larger of this and --max-rss-drift-pct")
    p.add_argument("--max-rss-drift-pct", type=float, default=1.0, help="percent of the RSS at the end of warm-up")
    p.add_argument("--max-kv-drift", type=float, default=0.25, help="absolute, KV usage is 0..1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=pathlib.Path, help="write the report here too")
    return p.parse_args(argv)


# -- the server ------------------------------------------------------------------------------------


def start_server(serve_args: list[str], log_path: Optional[str] = None, timeout_s: float = 300.0,
                 env: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, str]:
    """`python -m server.cli serve ...` (what the `pagedserve` script runs) on a free port; (proc, base_url)
    once /health is 200. The tests' servers in their own process start here too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    log = open(log_path or os.devnull, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = pathlib.Path(log_path).read_text()[-3000:] if log_path else "(no log file given)"
            raise RuntimeError(f"the server exited with {proc.returncode}: {tail}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server did not come up in {timeout_s:g} s")


def rss_bytes(pid: int) -> Optional[int]:
    """Resident set size of pid: psutil when installed, else /proc/<pid>/status."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:
        return None
    try:
        text = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+)\s+kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


def read_gauges(client: httpx.Client, base: str) -> dict[str, float]:
    text = client.get(base + "/metrics", timeout=10).text
    out = {}
    for name in GAUGES:
        m = re.search(rf"^pagedserve:{name}(?:\{{[^}}]*\}})?\s+(\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


# -- the traffic -----------------------------------------------------------------------------------


class Traffic:
    """Random mixed requests from `concurrency` clients; counts what happened to them."""

    def __init__(self, base: str, model: str, max_model_len: int, seed: int) -> None:
        self.base, self.model, self.max_model_len = base, model, max_model_len
        self.rng = random.Random(seed)
        self.counts: Counter = Counter()
        self.statuses: Counter = Counter()
        self.failures: list[str] = []

    def body(self) -> dict[str, Any]:
        rng = self.rng
        prompt_len = rng.randint(4, 64)
        return {"model": self.model, "prompt": [rng.randrange(100, 30000) for _ in range(prompt_len)],
                "max_tokens": rng.randint(4, min(48, self.max_model_len - prompt_len)), "ignore_eos": True,
                "temperature": rng.choice([0.0, 0.7]), "seed": rng.randrange(1 << 30)}

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(["stream", "plain", "chat", "n2", "best_of", "leave", "bad"],
                                weights=[25, 20, 10, 10, 8, 20, 7])[0]
        body = self.body()
        self.counts["sent"] += 1
        try:
            if kind in ("stream", "leave", "n2"):
                if kind == "n2":
                    body.update(n=2, temperature=0.8)
                await self.stream(client, body, leave_after=self.rng.randint(1, 4) if kind == "leave" else None)
            elif kind == "chat":
                chat = {k: v for k, v in body.items() if k != "prompt"}
                chat["messages"] = [{"role": "user", "content": "word " * self.rng.randint(1, 30)}]
                await self.plain(client, "/v1/chat/completions", chat, body["max_tokens"])
            elif kind == "best_of":
                body.update(best_of=2, n=1, temperature=0.8)
                await self.plain(client, "/v1/completions", body, body["max_tokens"])
            elif kind == "bad":
                bad = self.rng.choice([{**body, "temperature": -1}, {**body, "prompt": []}, {**body, "top_p": 1.5},
                                       {**body, "max_tokens": self.max_model_len * 2}])
                r = await client.post(self.base + "/v1/completions", json=bad)
                self.note(r.status_code, expect=400)
            else:
                await self.plain(client, "/v1/completions", body, body["max_tokens"])
        except httpx.HTTPError as exc:
            self.counts["transport_errors"] += 1
            self.failures.append(f"{kind}: {type(exc).__name__}: {exc}")

    def note(self, status: int, expect: int = 200, detail: str = "") -> bool:
        self.statuses[status] += 1
        if status != expect:
            self.failures.append(f"HTTP {status} (wanted {expect}) {detail[:200]}")
            return False
        self.counts["completed" if expect == 200 else "refused_as_expected"] += 1
        return True

    async def plain(self, client: httpx.AsyncClient, path: str, body: dict, max_tokens: int) -> None:
        r = await client.post(self.base + path, json=body)
        if self.note(r.status_code, detail=r.text):
            got = r.json()["usage"]["completion_tokens"]
            if got != max_tokens * body.get("n", 1):
                self.counts["wrong_token_counts"] += 1
                self.failures.append(f"{path}: {got} tokens, wanted {max_tokens * body.get('n', 1)}")

    async def stream(self, client: httpx.AsyncClient, body: dict, leave_after: Optional[int]) -> None:
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        usage, seen = None, 0
        async with client.stream("POST", self.base + "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                await r.aread()
                self.note(r.status_code, detail=r.text)
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                seen += 1
                event = json.loads(line[5:])
                if "error" in event:
                    self.note(int(event["error"].get("code") or 500), detail=line)
                    return
                usage = event.get("usage") or usage
                if leave_after is not None and seen >= leave_after:
                    self.counts["client_aborted"] += 1
                    return  # leaving the block closes the connection mid-stream
        want = body["max_tokens"] * body.get("n", 1)
        if self.note(200) and (usage is None or usage["completion_tokens"] != want):
            self.counts["wrong_token_counts"] += 1
            self.failures.append(f"stream: usage {usage}, wanted {want} tokens")

    async def run(self, concurrency: int, until: float) -> None:
        limits = httpx.Limits(max_connections=concurrency * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async def worker() -> None:
                while time.monotonic() < until:
                    await self.one(client)

            await asyncio.gather(*[worker() for _ in range(concurrency)])


async def sample(base: str, pid: Optional[int], interval: float, until: float, out: list[dict]) -> None:
    start = time.monotonic()
    with httpx.Client() as client:
        while time.monotonic() < until:
            gauges = await asyncio.to_thread(read_gauges, client, base)
            out.append({"t": round(time.monotonic() - start, 2), "rss": rss_bytes(pid) if pid else None, **gauges})
            await asyncio.sleep(interval)


# -- the verdict -----------------------------------------------------------------------------------


def drift(values: list[float]) -> Optional[float]:
    """Median of the second half minus median of the first half (None with too few samples).

    Medians over halves, not end points: RSS saws by tens of MiB as the engine hands freed heap pages
    back every few seconds, and a steady climb still shows as the difference of the halves."""
    if len(values) < 8:
        return None
    half = len(values) // 2
    return statistics.median(values[-half:]) - statistics.median(values[:half])


def slope_per_min(times: list[float], values: list[float]) -> Optional[float]:
    """Least-squares slope of values over times, per minute (None with too few samples)."""
    if len(values) < 8:
        return None
    mt, mv = statistics.fmean(times), statistics.fmean(values)
    var = sum((t - mt) ** 2 for t in times)
    return 60 * sum((t - mt) * (v - mv) for t, v in zip(times, values)) / var if var else None


def wait_idle(base: str, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while True:
            g = read_gauges(client, base)
            if all(g[k] == 0 for k in GAUGES) or time.monotonic() > deadline:
                return g
            time.sleep(0.2)


@contextlib.contextmanager
def soak_server(args: argparse.Namespace) -> Iterator[tuple[str, Optional[int]]]:
    """(base_url, pid) of the server under soak: the one at --url (--pid for its RSS), else one started here with
    --model and --server-args, stopped with SIGTERM afterwards."""
    if args.url:
        yield args.url.rstrip("/"), args.pid
        return
    serve_args = [*([args.model] if args.model else []), *shlex.split(args.server_args)]
    proc, base = start_server(serve_args, os.environ.get("SOAK_SERVER_LOG"))
    try:
        yield base, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def soak(args: argparse.Namespace) -> dict[str, Any]:
    with soak_server(args) as (base, pid):
        card = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]
        warmup = args.warmup_s if args.warmup_s is not None else 0.2 * args.duration_s
        traffic = Traffic(base, card["id"], card.get("max_model_len") or 256, args.seed)
        samples: list[dict] = []

        async def main() -> None:
            until = time.monotonic() + args.duration_s
            await asyncio.gather(traffic.run(args.concurrency, until),
                                 sample(base, pid, args.sample_interval_s, until, samples))

        started = time.monotonic()
        asyncio.run(main())
        elapsed = time.monotonic() - started
        idle = wait_idle(base)
        rss_after_idle = rss_bytes(pid) if pid else None
    steady = [s for s in samples if s["t"] >= warmup]
    rss = [s["rss"] for s in steady if s["rss"] is not None]
    kv = [s["kv_cache_usage_perc"] for s in steady]
    rss_drift = drift(rss)
    rss_slope = slope_per_min([s["t"] for s in steady if s["rss"] is not None], rss)
    kv_drift = drift(kv)
    report = {
        "duration_s": round(elapsed, 1), "warmup_s": warmup, "concurrency": args.concurrency,
        "requests_sent": traffic.counts["sent"], "completed": traffic.counts["completed"],
        "client_aborted": traffic.counts["client_aborted"], "refused_as_expected": traffic.counts["refused_as_expected"],
        "wrong_token_counts": traffic.counts["wrong_token_counts"], "transport_errors": traffic.counts["transport_errors"],
        "statuses": {str(k): v for k, v in sorted(traffic.statuses.items())},
        "5xx": sum(v for k, v in traffic.statuses.items() if k >= 500),
        "samples": len(samples), "steady_samples": len(steady),
        "rss_mib_start": round(rss[0] / 2**20, 1) if rss else None,
        "rss_mib_end": round(rss[-1] / 2**20, 1) if rss else None,
        "rss_mib_after_idle": round(rss_after_idle / 2**20, 1) if rss_after_idle else None,
        "rss_drift_mib": round(rss_drift / 2**20, 1) if rss_drift is not None else None,
        "rss_slope_mib_per_min": round(rss_slope / 2**20, 2) if rss_slope is not None else None,
        "kv_usage_mean": round(statistics.fmean(kv), 3) if kv else None,
        "kv_drift": round(kv_drift, 3) if kv_drift is not None else None,
        "idle_after": idle, "failures": traffic.failures[:20],
        # [t (s), RSS (MiB), KV usage] per sample: to see whether a drift saturates or keeps climbing.
        "series": [[s["t"], round(s["rss"] / 2**20, 1) if s["rss"] else None, round(s["kv_cache_usage_perc"], 3)]
                   for s in samples],
    }
    problems = []
    if report["5xx"]:
        problems.append(f"{report['5xx']} responses were 5xx")
    if traffic.failures:
        problems.append(f"{len(traffic.failures)} requests failed (see failures)")
    if any(idle[k] != 0 for k in GAUGES):
        problems.append(f"the server was not idle after the traffic: {idle}")
    # Flat means flat: the native caches that used to fill for minutes are bounded (server/cli.py) and freed
    # heap pages go back to the OS (engine/frontend/async_engine.py), so what is left is noise; the limit scales a
    # little with the process.
    rss_limit_mib = max(args.max_rss_drift_mib, args.max_rss_drift_pct / 100 * rss[0] / 2**20) if rss else None
    report["rss_drift_limit_mib"] = round(rss_limit_mib, 1) if rss_limit_mib else None
    if rss_drift is not None and rss_drift / 2**20 > rss_limit_mib:
        problems.append(f"RSS grew {rss_drift / 2**20:.1f} MiB after warm-up (limit {rss_limit_mib:.1f})")
    if pid and rss_drift is None:
        problems.append("too few RSS samples after warm-up to judge drift")
    if kv_drift is not None and kv_drift > args.max_kv_drift:
        problems.append(f"KV usage grew {kv_drift:.3f} after warm-up (limit {args.max_kv_drift})")
    report["problems"] = problems
    return report


def report_and_exit_code(report: dict[str, Any], json_path: Optional[pathlib.Path]) -> int:
    """Print the report (and write it where asked); 1 when it lists problems."""
    text = json.dumps(report, indent=2)
    print(text)
    if json_path:
        json_path.write_text(text)
    return 1 if report["problems"] else 0


def run(soak_fn: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace) -> int:
    """A soak's command line: run it offline-only, print its report, exit 1 on problems."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return report_and_exit_code(soak_fn(args), args.json)


def main(argv: Optional[list[str]] = None) -> int:
    return run(soak, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
