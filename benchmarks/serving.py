"""Serving benchmark: an async load generator for any OpenAI-compatible /v1/completions server.

Streams every request, measures TTFT, TPOT, ITL and E2E latency, request and
output-token throughput, and checks that each request got the tokens it asked
for (the usage chunk of `stream_options.include_usage`, or one logprobs entry
per token with --count-tokens logprobs). Prompts are random token ids (or random
words) drawn from a seed: nothing is downloaded. The default client (--client raw,
benchmarks/raw_client.py) is plain asyncio HTTP/1.1, a connection per request, lean because it shares the
machine with the server it measures; --client aiohttp streams through aiohttp.

    # one run: 64 requests, 32 in flight, 128 prompt tokens, 128 output tokens
    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:8000 --concurrency 32 --num-prompts 64
    # Poisson arrivals at 4 requests/s
    .venv/bin/python benchmarks/serving.py --request-rate 4 --num-prompts 64
    # sweep over concurrencies, JSON + PNG
    .venv/bin/python benchmarks/serving.py --sweep 1,4,16,32 --rounds 2 --plot benchmarks/results/serving.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import aiohttp
import httpx

from proc_cpu import CPUWindow  # benchmarks/proc_cpu.py: --server-pid's CPU accounting
from raw_client import RawStream, RawTarget  # benchmarks/raw_client.py: the default client's HTTP/1.1 and SSE

# Words for --prompt-kind text; random sentences of them tokenize to roughly one token per word.
_WORDS = ("the of and to in is was for on that with as by at from his her an which are were this be had not "
          "or have one all their but they first new after who time two years can more other into its some "
          "city world house water river music school family river light small large north south game war "
          "people state company market river story power field order number system member").split()


@dataclass
class RequestResult:
    """What one request saw; latencies in seconds."""

    prompt_len: int  # tokens when sent as ids; words for text prompts (usage.prompt_tokens when reported)
    max_tokens: int
    output_tokens: int = 0
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks carrying text


def make_requests(args, rng: random.Random) -> list[tuple[object, int, int]]:
    """(prompt, prompt_len, max_tokens) per request; lengths uniform in [len * (1 - range), len * (1 + range)]."""
    def length(mean: int, spread: float) -> int:
        low, high = max(1, int(mean * (1 - spread))), max(1, int(mean * (1 + spread)))
        return rng.randint(low, high)

    out = []
    for _ in range(args.num_prompts):
        n_in, n_out = length(args.input_len, args.input_len_range), length(args.output_len, args.output_len_range)
        if args.prompt_kind == "tokens":
            prompt: object = [rng.randrange(args.token_id_low, args.token_id_high) for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        out.append((prompt, n_in, n_out))
    return out


async def send(client: aiohttp.ClientSession, args, model: str, prompt, prompt_len: int,
               max_tokens: int) -> RequestResult:
    """One streamed completion; records chunk arrival times and the token count the server reports.

    aiohttp, not httpx: the client shares the machine with the server it measures, and for the same 8,192 streamed
    tokens (64 streams, tiny model, 2 vCPU Xeon) httpx's line iterator took 1.30 CPU-s, aiohttp 0.35 (the server's
    TPOT p50 20.1 -> 13.1 ms with the CPU left to it)."""
    res = RequestResult(prompt_len=prompt_len, max_tokens=max_tokens)
    body = request_body(args, model, prompt, max_tokens)
    start = time.perf_counter()
    last, usage_tokens, counted = None, None, 0
    try:
        async with client.post(args.base_url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return res
            async for line in resp.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue  # blank separators, ": ping" comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    res.prompt_len = chunk["usage"].get("prompt_tokens", prompt_len)
                for choice in chunk.get("choices") or []:
                    lp = choice.get("logprobs")
                    if lp and lp.get("tokens") is not None:
                        counted += len(lp["tokens"])
                    if choice.get("text"):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    res.e2e = time.perf_counter() - start
    return conclude(res, args, usage_tokens, counted, last is not None)


def request_body(args, model: str, prompt, max_tokens: int) -> dict:
    """The streamed /v1/completions request, the same for both clients."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature,
            "stream": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.count_tokens == "usage":
        body["stream_options"] = {"include_usage": True}
    else:
        body["logprobs"] = 0  # one logprobs entry per token in every chunk
    return body


def conclude(res: RequestResult, args, usage_tokens: Optional[int], counted: int, saw_text: bool) -> RequestResult:
    """A stream that ended without an error: ok when it carried text and the tokens asked for."""
    res.output_tokens = usage_tokens if args.count_tokens == "usage" else counted
    if res.output_tokens is None:
        res.error, res.output_tokens = "no usage chunk in the stream (try --count-tokens logprobs)", 0
    elif not saw_text:
        res.error = "no text chunk arrived"
    elif args.ignore_eos and res.output_tokens != res.max_tokens:
        res.error = f"asked for {res.max_tokens} tokens, got {res.output_tokens}"
    else:
        res.ok = True
    return res


async def send_raw(target: RawTarget, args, model: str, prompt, prompt_len: int, max_tokens: int) -> RequestResult:
    """`send` on plain asyncio: the same request and RequestResult at a fraction of aiohttp's CPU an event."""
    res = RequestResult(prompt_len=prompt_len, max_tokens=max_tokens)
    payload = json.dumps(request_body(args, model, prompt, max_tokens)).encode()
    start = time.perf_counter()
    stream = RawStream(res, start, args.count_tokens == "logprobs")

    async def exchange() -> None:
        await asyncio.get_running_loop().create_connection(lambda: stream, target.host, target.port)
        stream.transport.write(b"%s%d\r\n\r\n%s" % (target.head, len(payload), payload))
        await stream.done

    try:
        await asyncio.wait_for(exchange(), args.timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        stream.close()
    if res.error:
        return res
    return conclude(res, args, stream.usage_tokens, stream.counted, stream.last is not None)


async def probe_health(client: aiohttp.ClientSession, base_url: str, interval: float,
                       latencies: list[float]) -> None:
    """GET /health every `interval` seconds until cancelled, each answer's latency (s) appended to `latencies`:
    whether the server's event loop stays responsive under the load."""
    while True:
        t = time.perf_counter()
        async with client.get(f"{base_url}/health") as response:
            await response.read()
        latencies.append(time.perf_counter() - t)
        response.raise_for_status()
        await asyncio.sleep(interval)


def plan_requests(args, level: Optional[int]) -> tuple[list, list]:
    """(warm-ups, timed requests) for one concurrency level. The warm-ups are prompts of their own: a warm-up
    that repeats a timed prompt hands a server with a prompt cache (llama-server's, by default) that request's
    prefill for free (it read llama.cpp's first token at one stream ~40 % early). Each level draws its own
    prompts too, so a sweep run against one server never repeats a prompt across levels."""
    timed = make_requests(args, random.Random(f"{args.seed}/{level}"))
    warmups = make_requests(args, random.Random(f"{args.seed}/{level}/warmup"))[: args.warmup]
    return warmups, timed


async def run_load(args, model: str, requests: list, concurrency: Optional[int], rate: float,
                   health: Optional[list[float]] = None, warmups: list = (),
                   server_cpu: Optional[CPUWindow] = None) -> tuple[list, float, float]:
    """Send every request with at most `concurrency` in flight, arrivals Poisson at `rate` (inf: all at once),
    after the `warmups` one by one (untimed); with `health` (a list), probe /health every --health-interval
    seconds meanwhile into it; with `server_cpu`, its window is the timed part. Returns (results, seconds, this
    client's CPU seconds) of the timed part."""
    limit = concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(args.seed + 1)
    # A connection per request: llama-server closes kept-alive connections under load, and aiohttp does not retry
    # a POST whose pooled connection the server had closed (4 of 64 requests failed at 32 streams).
    connector = aiohttp.TCPConnector(limit=limit + 4, force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout), connector=connector) as client:
        if args.client == "raw":
            target = await RawTarget.resolve(args.base_url)

            def post(prompt, prompt_len: int, max_tokens: int):
                return send_raw(target, args, model, prompt, prompt_len, max_tokens)
        else:
            def post(prompt, prompt_len: int, max_tokens: int):
                return send(client, args, model, prompt, prompt_len, max_tokens)

        async def one(req) -> RequestResult:
            async with sem:
                return await post(*req)

        for req in warmups:  # untimed: kernel build, allocator, connection setup
            await post(req[0], req[1], min(req[2], 4))
        if server_cpu is not None:
            server_cpu.start()
        start, cpu_start = time.perf_counter(), time.process_time()
        probe = None
        if health is not None:
            probe = asyncio.create_task(probe_health(client, args.base_url, args.health_interval, health))
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if server_cpu is not None:
            server_cpu.stop()
        if probe is not None:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
    return results, duration, cpu


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    """mean / p50 / p99 (milliseconds by default); zeros when there is nothing to summarise."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered) * scale, "p50": pct(50) * scale, "p99": pct(99) * scale}


def summarize(results: list[RequestResult], duration: float, concurrency: Optional[int], rate: float) -> dict:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    return {
        "concurrency": concurrency, "request_rate": rate if math.isfinite(rate) else "inf",
        "num_requests": len(results), "completed": len(good), "failed": len(results) - len(good),
        "all_tokens_received": len(good) == len(results),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in good), "total_output_tokens": out_tokens,
        "request_throughput": len(good) / duration, "output_throughput": out_tokens / duration,
        "ttft_ms": _stats([r.ttft for r in good]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in good for x in r.itl]), "e2e_ms": _stats([r.e2e for r in good]),
    }


def print_summary(s: dict) -> None:
    load = f"concurrency {s['concurrency']}" if s["concurrency"] else f"rate {s['request_rate']}/s"
    print(f"[{load}] {s['completed']}/{s['num_requests']} ok in {s['duration_s']:.1f} s: "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        print(f"    {key[:-3].upper():5s} mean {v['mean']:8.1f}  p50 {v['p50']:8.1f}  p99 {v['p99']:8.1f} ms")
    for err in s["errors"]:
        print(f"    error: {err}")


def print_server_cpu(summary: dict, used: dict[int, float], client_cpu: float) -> None:
    """--server-pid: each server process's CPU seconds, per output token, and the cores the run kept busy."""
    tokens = max(summary["total_output_tokens"], 1)
    parts = [f"pid {pid} {s:.2f} s ({s / tokens * 1e6:.0f} us a token)" for pid, s in used.items() if s >= 0.01]
    busy = (sum(used.values()) + client_cpu) / summary["duration_s"]
    print(f"    server CPU {', '.join(parts) or 'none'}; with the client {busy:.2f} cores busy of {os.cpu_count()}")


def server_model(base_url: str, timeout: float) -> str:
    """The first model id the server lists."""
    resp = httpx.get(base_url + "/v1/models", timeout=timeout)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--label", default=None, help="name of this server in the JSON and the plot")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: all)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf)")
    p.add_argument("--sweep", default=None, help="comma-separated concurrencies, e.g. 1,4,16,32")
    p.add_argument("--rounds", type=float, default=2.0,
                   help="sweep: requests per level = max(--num-prompts-min, rounds * concurrency)")
    p.add_argument("--num-prompts-min", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len-range", type=float, default=0.0, help="0: fixed; 0.5: uniform in [0.5x, 1.5x]")
    p.add_argument("--output-len-range", type=float, default=0.0)
    p.add_argument("--health-interval", type=float, default=0.0,
                   help="seconds between GET /health probes during the load, latencies in the report (0: none)")
    p.add_argument("--prompt-kind", choices=["tokens", "text"], default="tokens")
    p.add_argument("--token-id-low", type=int, default=1000)
    p.add_argument("--token-id-high", type=int, default=10000)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos (vLLM extension); without it, EOS may end a request early")
    p.add_argument("--count-tokens", choices=["usage", "logprobs"], default="usage")
    p.add_argument("--client", choices=["raw", "aiohttp"], default="raw",
                   help="raw: plain asyncio HTTP/1.1, the least CPU taken from a server on the same cores; "
                        "aiohttp: the aiohttp client (also https)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--server-pid", type=int, default=None,
                   help="Linux: report the CPU of this process and its children (an engine core) over each run")
    p.add_argument("--output-json", default="benchmarks/results/serving.json")
    p.add_argument("--plot", default=None, help="PNG path: throughput and latency against concurrency")
    p.add_argument("--strict", action="store_true", help="exit 1 when any request failed or got too few tokens")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    model = args.model or server_model(args.base_url, args.timeout)
    levels = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.concurrency]
    runs = []
    for level in levels:
        if args.sweep:
            args.num_prompts = max(args.num_prompts_min, int(args.rounds * level))
        warmups, requests = plan_requests(args, level)
        health = [] if args.health_interval > 0 else None
        server_cpu = CPUWindow(args.server_pid) if args.server_pid else None
        results, duration, cpu = asyncio.run(run_load(args, model, requests, level, args.request_rate, health,
                                                      warmups, server_cpu))
        summary = summarize(results, duration, level, args.request_rate)
        # The client's own CPU: on a machine it shares with the server, what it takes from the server.
        summary["client_cpu_s"] = cpu
        print_summary(summary)
        print(f"    client CPU {cpu:.2f} s ({cpu / duration:.0%} of a core, {args.client} client)")
        if server_cpu is not None:
            summary["server_cpu_s"] = {str(pid): s for pid, s in server_cpu.used.items()}
            print_server_cpu(summary, server_cpu.used, cpu)
        if health:
            summary["health_ms"] = {**_stats(health), "max": max(health) * 1000}
            h = summary["health_ms"]
            print(f"    /health p50 {h['p50']:.1f}  p99 {h['p99']:.1f}  max {h['max']:.1f} ms ({len(health)} probes)")
        runs.append(summary)
    config = {k: v for k, v in vars(args).items() if k not in ("plot",)}
    config["request_rate"] = "inf" if not math.isfinite(args.request_rate) else args.request_rate
    report = {"label": args.label or model, "base_url": args.base_url, "model": model,
              "machine": {"platform": platform.platform(), "python": platform.python_version()},
              "config": config, "runs": runs}
    path = Path(args.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    if args.plot:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from plot import plot_reports

        plot_reports([report], args.plot)
        print(f"wrote {args.plot}")
    return 1 if args.strict and not all(r["all_tokens_received"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
