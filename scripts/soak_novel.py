#!/usr/bin/env python
"""Soak with input the server has never seen: every request carries a new JSON schema (response_format
json_schema) and new unknown field names; then one big body of unknown keys while /health is polled.

    python scripts/soak_novel.py                                  # start `pagedserve serve` (default model)
    python scripts/soak_novel.py --model /path/to/hf --requests 300
    python scripts/soak_novel.py --url http://127.0.0.1:8000 --pid 1234   # a running server (pid: for its RSS)

Two equal rounds of --requests requests: the first warms the server up (the compiled-grammar cache fills to its
bound, allocator arenas grow), the second may grow the server's RSS by at most --max-rss-growth-mib. RSS is read
after each round once the server is idle and has handed freed heap pages back (the engine trims every 10 s).
Then one chat body of 1024 messages with 40 extra keys each (~0.7 MiB, every key new) must be answered within
--max-big-body-s while /health, polled beside it, answers each time within --max-health-s. The exit status is 1
when a limit is passed or a request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any, Optional

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from soak import add_server_args, rss_bytes, run, soak_server, wait_idle  # noqa: E402

TRIM_WAIT_S = 11.0  # the engine hands freed heap back at most every 10 s (engine/frontend/async_engine.py TRIM_INTERVAL_S)
BIG_MESSAGES, BIG_KEYS = 1024, 40


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--requests", type=int, default=300, help="requests per round")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--schemas", choices=["bounded", "unbounded"], default="bounded",
                   help="string and array bounds in the schemas (bounded: ~45x the compiled size)")
    p.add_argument("--max-rss-growth-mib", type=float, default=12.0, help="RSS growth allowed in the second round")
    p.add_argument("--trim-wait-s", type=float, default=TRIM_WAIT_S,
                   help="idle seconds before each RSS read, so that the engine trims the heap first")
    p.add_argument("--max-big-body-s", type=float, default=3.0)
    p.add_argument("--max-health-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=pathlib.Path, help="write the report here too")
    return p.parse_args(argv)


# -- the traffic -----------------------------------------------------------------------------------


def novel_schema(tag: str, bounded: bool = True) -> dict[str, Any]:
    """A small object schema whose property names no earlier request used. Bounded strings and arrays compile
    to ~1.8 MB with SmolLM2's vocabulary, unbounded ones to ~40 KB."""
    bounds = ({"maxLength": 8}, {"maxLength": 4}, {"maxItems": 2}) if bounded else ({}, {}, {})
    kinds = [{"type": "string", **bounds[0]}, {"type": "integer"}, {"type": "boolean"},
             {"type": "array", "items": {"type": "string", **bounds[1]}, **bounds[2]}]
    props = {f"p_{tag}_{j}": kind for j, kind in enumerate(kinds)}
    return {"type": "object", "properties": props, "required": [f"p_{tag}_0"]}


class NovelTraffic:
    """Requests that each bring a new schema and new unknown field names; counts what happened to them."""

    def __init__(self, base: str, model: str, max_tokens: int, seed: int, bounded: bool) -> None:
        self.base, self.model, self.max_tokens, self.bounded = base, model, max_tokens, bounded
        self.rng = random.Random(seed)
        self.nonce = f"{random.Random().getrandbits(32):08x}"  # new names against a server already running too
        self.statuses: Counter = Counter()
        self.failures: list[str] = []

    def body(self, tag: str) -> tuple[str, dict[str, Any]]:
        tag = f"{self.nonce}_{tag}"
        extra = {f"x_{tag}_{j}": j for j in range(4)}  # top-level unknown fields
        fmt = {"type": "json_schema", "json_schema": {"name": f"s_{tag}", "schema": novel_schema(tag, self.bounded)}}
        common = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0, "response_format": fmt,
                  **extra}
        if self.rng.random() < 0.5:
            messages = [{"role": "user", "content": "Describe a thing as JSON.", f"m_{tag}": True}]  # nested unknown
            return "/v1/chat/completions", {**common, "messages": messages}
        stream_options = {"include_usage": True, f"o_{tag}": 1}
        return "/v1/completions", {**common, "prompt": "A JSON object:", "stream": True,
                                   "stream_options": stream_options}

    async def one(self, client: httpx.AsyncClient, tag: str) -> None:
        path, body = self.body(tag)
        try:
            if body.get("stream"):
                async with client.stream("POST", self.base + path, json=body) as r:
                    text = (await r.aread()).decode()
                ok = r.status_code == 200 and '"error"' not in text and "data: [DONE]" in text
            else:
                r = await client.post(self.base + path, json=body)
                text = r.text
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            self.statuses[r.status_code] += 1
            if not ok:
                self.failures.append(f"{path}: HTTP {r.status_code} {text[:300]}")
        except httpx.HTTPError as exc:
            self.statuses["transport_error"] += 1
            self.failures.append(f"{path}: {type(exc).__name__}: {exc}")

    async def round(self, index: int, requests: int, concurrency: int) -> float:
        tags = iter(f"r{index}_{i}" for i in range(requests))
        start = time.monotonic()
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency * 2)) as client:
            async def worker() -> None:
                for tag in tags:
                    await self.one(client, tag)

            await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.monotonic() - start


# -- the measurements ------------------------------------------------------------------------------


def settled_rss_mib(base: str, pid: int, model: str, trim_wait_s: float) -> float:
    """The server's RSS once idle and past a heap trim: wait out the trim interval, let one small request make
    the engine trim (it does between steps, and when it goes idle), then the median of five reads."""
    wait_idle(base)
    time.sleep(trim_wait_s)
    httpx.post(base + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1}, timeout=120)
    wait_idle(base)
    time.sleep(1.0)
    reads = []
    for _ in range(5):
        reads.append(rss_bytes(pid) / 2**20)
        time.sleep(0.2)
    return statistics.median(reads)


def big_body(model: str) -> bytes:
    """1024 messages with 40 extra keys each, every key new (~0.7 MiB)."""
    nonce = f"{random.Random().getrandbits(16):04x}"
    messages = [{"role": "user", "content": "hi", **{f"k{nonce}{i:03x}{j:02d}": "v" for j in range(BIG_KEYS)}}
                for i in range(BIG_MESSAGES)]
    return json.dumps({"model": model, "messages": messages, "max_tokens": 1}).encode()


async def big_body_with_health(base: str, body: bytes) -> dict[str, Any]:
    """POST the big body and poll /health beside it until it is answered."""
    async with httpx.AsyncClient(timeout=300) as client:
        start = time.monotonic()
        request = asyncio.create_task(client.post(base + "/v1/chat/completions", content=body,
                                                  headers={"content-type": "application/json"}))
        waits, statuses = [], Counter()
        while not request.done():
            t = time.monotonic()
            statuses[(await client.get(base + "/health")).status_code] += 1
            waits.append(time.monotonic() - t)
            await asyncio.sleep(0.05)
        r = await request
        took = time.monotonic() - start
    return {"status": r.status_code, "seconds": round(took, 3), "body_mib": round(len(body) / 2**20, 3),
            "health_polls": len(waits), "health_max_s": round(max(waits), 3) if waits else None,
            "health_statuses": {str(k): v for k, v in statuses.items()}, "answer": r.text[:200]}


def cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    except OSError:
        pass
    return f"unknown, {os.cpu_count()} CPUs"


def soak(args: argparse.Namespace) -> dict[str, Any]:
    with soak_server(args) as (base, pid):
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        traffic = NovelTraffic(base, model, args.max_tokens, args.seed, args.schemas == "bounded")
        rounds = []
        for index in range(2):  # the first warms up; the second must not grow
            took = asyncio.run(traffic.round(index, args.requests, args.concurrency))
            rss = settled_rss_mib(base, pid, model, args.trim_wait_s) if pid else None
            rounds.append({"seconds": round(took, 1), "rss_mib": round(rss, 1) if rss is not None else None})
        big = asyncio.run(big_body_with_health(base, big_body(model)))
        health_after = httpx.get(base + "/health", timeout=10).status_code
    growth = rounds[1]["rss_mib"] - rounds[0]["rss_mib"] if pid else None
    report = {
        "cpu": cpu_name(), "requests_per_round": args.requests, "concurrency": args.concurrency,
        "schemas": args.schemas,
        "rounds": rounds, "rss_growth_mib": round(growth, 1) if growth is not None else None,
        "rss_growth_limit_mib": args.max_rss_growth_mib,
        "statuses": {str(k): v for k, v in sorted(traffic.statuses.items(), key=str)},
        "failures": traffic.failures[:20], "big_body": big, "health_after": health_after,
    }
    problems = []
    if traffic.failures:
        problems.append(f"{len(traffic.failures)} requests failed (see failures)")
    if growth is not None and growth >= args.max_rss_growth_mib:
        problems.append(f"RSS grew {growth:.1f} MiB in the second round (limit {args.max_rss_growth_mib:g})")
    if pid is None:
        problems.append("no server pid: RSS not measured")
    if big["status"] not in (200, 400) or big["seconds"] >= args.max_big_body_s:  # 400: longer than the context
        problems.append(f"the big body got {big['status']} after {big['seconds']} s (limit {args.max_big_body_s:g} s)")
    if big["health_max_s"] is not None and big["health_max_s"] >= args.max_health_s:
        problems.append(f"/health waited {big['health_max_s']} s beside the big body (limit {args.max_health_s:g} s)")
    if set(big["health_statuses"]) - {"200"} or health_after != 200:
        problems.append(f"/health was not always 200: {big['health_statuses']}, then {health_after}")
    report["problems"] = problems
    return report


def main(argv: Optional[list[str]] = None) -> int:
    return run(soak, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
