"""Paged decode attention vs torch SDPA over a contiguous cache, on the current device.

    python benchmarks/kernels.py                 # small CPU-friendly grid (~1 min)
    python benchmarks/kernels.py --full          # batch 1..256 x context 128..4096

Prints a table and writes JSON (default benchmarks/results/kernels.json).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import ops  # noqa: E402

FULL_BATCHES = [1, 8, 32, 64, 128, 256]
FULL_CONTEXTS = [128, 512, 1024, 2048, 4096]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def timed(fn, device: torch.device, min_time: float) -> float:
    """Median seconds per call over repeats filling about min_time."""
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench_case(batch, context, args, device, dtype) -> dict:
    """One (batch, context) point: every sequence holds `context` tokens."""
    h, kvh, d, bs = args.num_heads, args.num_kv_heads, args.head_size, args.block_size
    blocks_per_seq = (context + bs - 1) // bs
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(batch * blocks_per_seq, kvh, bs, d, generator=gen).to(device, dtype)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(batch, h, d, generator=gen).to(device, dtype)
    # Shuffled physical blocks, as after a while of serving.
    tables = torch.randperm(batch * blocks_per_seq, generator=gen).view(batch, blocks_per_seq)
    tables = tables.to(device=device, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    scale = d ** -0.5

    # SDPA baseline: the same K/V already contiguous per sequence, GQA expanded.
    k = torch.randn(batch, kvh, context, d, generator=gen).to(device, dtype)
    v = torch.randn_like(k)
    k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    q4 = query.unsqueeze(2)  # [batch, heads, 1, head_size]

    paged = timed(lambda: ops.paged_attention(out, query, key_cache, value_cache, tables, lens, scale),
                  device, args.min_time)
    sdpa = timed(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale), device, args.min_time)
    kv_bytes = 2 * batch * context * kvh * d * key_cache.element_size()
    return dict(batch=batch, context=context, paged_ms=paged * 1e3, sdpa_ms=sdpa * 1e3,
                ratio=paged / sdpa, paged_gb_s=kv_bytes / paged / 1e9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="batch 1..256 x context 128..4096")
    p.add_argument("--batches", type=int, nargs="*")
    p.add_argument("--contexts", type=int, nargs="*")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--min-time", type=float, default=0.2, help="seconds of repeats per measurement")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kernels.json"))
    args = p.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    small = device.type == "cpu" and not args.full
    batches = args.batches or ([1, 8, 32] if small else FULL_BATCHES)
    contexts = args.contexts or ([128, 512, 1024] if small else FULL_CONTEXTS)

    backend = ops.backend()
    print(f"device: {device_name(device)}  backend: {backend.value}  dtype: {args.dtype}  "
          f"heads {args.num_heads}/{args.num_kv_heads} x {args.head_size}, block {args.block_size}")
    print(f"{'batch':>6} {'context':>8} {'paged ms':>10} {'sdpa ms':>10} {'paged/sdpa':>11} {'KV GB/s':>9}")
    rows = []
    for batch in batches:
        for context in contexts:
            r = bench_case(batch, context, args, device, dtype)
            rows.append(r)
            print(f"{r['batch']:>6} {r['context']:>8} {r['paged_ms']:>10.3f} {r['sdpa_ms']:>10.3f} "
                  f"{r['ratio']:>11.2f} {r['paged_gb_s']:>9.1f}", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=device_name(device), backend=backend.value, dtype=args.dtype, num_heads=args.num_heads,
                num_kv_heads=args.num_kv_heads, head_size=args.head_size, block_size=args.block_size,
                torch=torch.__version__)
    out.write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
