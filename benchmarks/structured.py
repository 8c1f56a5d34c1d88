"""Structured outputs against a running server: validity over 20 schemas, throughput cost, compile time.

1. Validity: each of SCHEMAS through `response_format` json_schema, greedy and sampled (seeded), with a
   max_tokens budget: every output that finishes with "stop" must parse and validate against its schema;
   one cut by max_tokens must say "length".
2. Throughput at --concurrency (default 32): the same chat requests unconstrained and then with a typical
   record schema (LONG_RECORD), every request --output-len tokens, output tok/s of each and their ratio.
3. Compile time: time to first token of a schema the server has not seen, of the same schema again
   (cached), and of an unconstrained request, each the median of --ttft-rounds.
Prints the figures and writes JSON. Validation uses jsonschema_rs (schemathesis brings it: dev extra).

    .venv/bin/pagedserve serve --port 8123 &
    .venv/bin/python benchmarks/structured.py --base-url http://127.0.0.1:8123
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

_STR = {"type": "string", "maxLength": 24}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": _STR, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "unsure"]}}, "required": ["answer"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 4}},
     "required": ["tags"]},
    {"type": "object", "properties": {"city": _STR, "country": _STR, "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "country", "population"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                               "email": _STR},
                                               "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "object", "properties": {"title": _STR, "subtitle": _STR}, "required": ["title"]},  # optional field
    {"type": "object", "properties": {"date": {"type": "string", "pattern": r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": _STR}, "required": ["ok", "reason"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 100}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": _STR, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "hex": {
        "type": "string", "pattern": "^#[0-9a-f]{6}$"}}, "required": ["color", "hex"]},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}},
     "required": ["lat", "lon"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["sentiment", "confidence"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": _STR, "maxItems": 3},
                                      "result": {"type": "integer"}}, "required": ["steps", "result"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},  # nested 3 deep
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"name": _STR, "nickname": {"anyOf": [_STR, {"type": "null"}]}},
     "required": ["name", "nickname"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer"}, "maxItems": 2}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"event": _STR, "attendees": {"type": "integer", "minimum": 1, "maximum": 500},
                                      "public": {"type": "boolean"}}, "required": ["event", "attendees", "public"],
     "additionalProperties": False},
]
TYPICAL = SCHEMAS[4]
# The throughput part compares equal work: every request runs to max_tokens, so the constrained ones get a
# typical record whose free-text field cannot close before the budget ends (a schema that closes early makes
# shorter requests, whose prefill then weighs more per output token: the first runs read 0.76 that way).
LONG_RECORD = {"type": "object", "properties": {"city": _STR, "population": {"type": "integer"},
                                                "description": {"type": "string", "minLength": 4000}},
               "required": ["city", "population", "description"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64, help="tokens per request in the throughput part")
    p.add_argument("--ttft-rounds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="throughput runs of each kind, alternating")
    p.add_argument("--parts", default="validity,throughput,ttft", help="which parts to run (comma-separated)")
    p.add_argument("--output-json", default="benchmarks/results/structured.json")
    return p.parse_args(argv)


async def chat(client: httpx.AsyncClient, args, model: str, prompt: str, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens, **extra}
    r = await client.post(args.base_url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


async def validity(client, args, model) -> dict:
    import jsonschema_rs

    rows, ok, cut, invalid = [], 0, 0, []
    for i, schema in enumerate(SCHEMAS):
        for mode, sampling in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": i})):
            out = await chat(client, args, model, "Answer as JSON.", response_format=response_format(schema),
                             **sampling)
            choice = out["choices"][0]
            text, reason = choice["message"]["content"], choice["finish_reason"]
            if reason == "length":
                cut += 1
                good = True  # cut by the budget and said so
            else:
                try:
                    good = reason == "stop" and jsonschema_rs.validator_for(schema).is_valid(json.loads(text))
                except ValueError:
                    good = False
                ok += good
            if not good:
                invalid.append({"schema": i, "mode": mode, "finish_reason": reason, "text": text[:200]})
            rows.append({"schema": i, "mode": mode, "finish_reason": reason, "valid": good})
    finished = len(rows) - cut
    return {"outputs": len(rows), "finished_stop": finished, "valid_of_finished": ok, "cut_by_length": cut,
            "valid_fraction": ok / finished if finished else None, "invalid": invalid}


async def throughput(client, args, model, extra: dict) -> dict:
    sem = asyncio.Semaphore(args.concurrency)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with sem:
            out = await chat(client, args, model, f"Describe city number {i} as JSON.", temperature=0.8, seed=i,
                             max_tokens=args.output_len, ignore_eos=True, **extra)
            tokens += out["usage"]["completion_tokens"]

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.num_requests)))
    elapsed = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": elapsed, "output_tok_s": tokens / elapsed}


async def ttft(client, args, model, extra_for_round) -> float:
    """Median time to the first streamed content of a 1-token-budget-free request (ms)."""
    times = []
    for r in range(args.ttft_rounds):
        body = {"model": model, "messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 4,
                "temperature": 0, "stream": True, **extra_for_round(r)}
        start = time.perf_counter()
        async with client.stream("POST", args.base_url + "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"content":"' in line.replace(" ", "") and '"content":""' not in \
                        line.replace(" ", ""):
                    times.append((time.perf_counter() - start) * 1e3)
                    break
    return statistics.median(times)


async def run(args) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
        await throughput(client, argparse.Namespace(**{**vars(args), "num_requests": 4}), model, {})  # warm-up
        parts = set(args.parts.split(","))
        valid = await validity(client, args, model) if "validity" in parts else None
        # Alternating runs, best of each: other load on the machine hits both alike.
        frees, constraineds = [{"output_tok_s": float("nan")}], [{"output_tok_s": float("nan")}]
        for _ in range(args.rounds if "throughput" in parts else 0):
            frees.append(await throughput(client, args, model, {}))
            constraineds.append(await throughput(client, args, model,
                                                 {"response_format": response_format(LONG_RECORD)}))
        free = max(frees[-args.rounds:], key=lambda r: r["output_tok_s"])
        constrained = max(constraineds[-args.rounds:], key=lambda r: r["output_tok_s"])

        def fresh(r: int) -> dict:  # a schema no request used before: a new property name each round
            schema = {"type": "object", "properties": {f"k{uuid.uuid4().hex[:8]}": {"type": "integer"}}}
            return {"response_format": response_format(schema)}

        nan = float("nan")
        ttft_new, ttft_cached, ttft_free = nan, nan, nan
        if "ttft" in parts:
            ttft_new = await ttft(client, args, model, fresh)
            ttft_cached = await ttft(client, args, model, lambda r: {"response_format": response_format(TYPICAL)})
            ttft_free = await ttft(client, args, model, lambda r: {})
    return {"validity": valid, "throughput_unconstrained": free, "throughput_constrained": constrained,
            "constrained_over_unconstrained": constrained["output_tok_s"] / free["output_tok_s"],
            "ttft_ms": {"new_schema": ttft_new, "cached_schema": ttft_cached, "unconstrained": ttft_free,
                        "compile_ms": ttft_new - ttft_cached, "cached_overhead_ms": ttft_cached - ttft_free}}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    report = asyncio.run(run(args))
    v, t = report["validity"] or {"valid_of_finished": 0, "finished_stop": 0, "cut_by_length": 0, "outputs": 0}, \
        report["ttft_ms"]
    print(f"validity: {v['valid_of_finished']}/{v['finished_stop']} finished outputs valid "
          f"({v['cut_by_length']} of {v['outputs']} cut by max_tokens, reported as length)")
    print(f"throughput at C={args.concurrency}: unconstrained {report['throughput_unconstrained']['output_tok_s']:.1f}"
          f" tok/s, constrained {report['throughput_constrained']['output_tok_s']:.1f} tok/s, "
          f"ratio {report['constrained_over_unconstrained']:.2f}")
    print(f"TTFT ms: new schema {t['new_schema']:.1f}, cached {t['cached_schema']:.1f}, unconstrained "
          f"{t['unconstrained']:.1f} (compile ~{t['compile_ms']:.1f} ms, cached overhead {t['cached_overhead_ms']:.1f} ms)")
    report.update(machine={"platform": platform.platform(), "processor": platform.processor()}, config=vars(args))
    path = Path(args.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0 if v["valid_of_finished"] == v["finished_stop"] else 1


if __name__ == "__main__":
    sys.exit(main())
