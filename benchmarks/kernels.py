"""CPU/GPU kernel timings: paged decode attention (vs SDPA), silu_and_mul, the prefill attention path, and the CPU
linears over GGML block formats (Q8_0 .. Q6_K).

    python benchmarks/kernels.py                 # paged attention, small CPU-friendly grid (~1 min)
    python benchmarks/kernels.py --full          # batch 1..256 x context 128..4096
    python benchmarks/kernels.py --smollm2 --ops paged,silu,prefill --batches 1 32 --contexts 192 2048

--smollm2 sets the default model's shapes (9/3 heads of 64, intermediate 1536). `paged` times
ops.paged_attention, `silu` ops.silu_and_mul on [batch, 2 * intermediate], `prefill` one
layer's Attention.forward for one prompt per --prompt-lens (plus, with --cached, a prompt
whose first half is read back from the prefix cache). `quant` times ops.kquant_gemm per --formats on a [2048, 8192]
and an [8192, 2048] weight at --quant-rows rows (a decode step reads every weight once: GB/s of packed weight
bytes is the figure; run it again under PAGEDSERVE_CPU_ISA=avx2 for an AVX2 CPU's paths; with OMP_NUM_THREADS=1 it
times the thread's CPU clock, not the wall clock). `q8` times ops.q8_gemm per forced path (--q8-paths) and torch's
linear on the float weight (path "float32") over --q8-shapes and --q8-rows (GB/s of the weight read, GFLOP/s); x and
out of both are --dtype (float32 or bfloat16; the panels multiply bfloat16 where the CPU has AVX-512 BF16). `moe`
times ops.moe_experts over GGUF-typed experts (--moe-types, gate:up:down each; e.g. a Q4_K_M file's Q4_K:Q4_K:Q6_K
against Q8_0:Q8_0:Q8_0) at --moe-shape (hidden x expert intermediate x experts x top-k; default A3B-like) and
--moe-rows decode rows, each row's experts drawn at random: ms, the expert bytes moe_bytes_read counts and their
GB/s. Prints tables and writes JSON (default benchmarks/results/kernels.json).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.platform.openmp import apply_serving_default  # noqa: E402  (no torch import)

apply_serving_default()  # as `pagedserve serve` does, before torch loads libgomp
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine import ops  # noqa: E402
from engine.model_executor.layers.attention import Attention, AttentionMetadata, PrefillSpan  # noqa: E402

FULL_BATCHES = [1, 8, 32, 64, 128, 256]
FULL_CONTEXTS = [128, 512, 1024, 2048, 4096]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def timed(fn, device: torch.device, min_time: float) -> float:
    """Median seconds per call. On CUDA: CUDA events around 20 back-to-back calls, repeated for about min_time
    (launches included, no host synchronization per call); on the CPU: a wall clock per call."""
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        calls, per_call = 20, []
        start = time.perf_counter()
        while len(per_call) < 5 or (time.perf_counter() - start < min_time and len(per_call) < 200):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            per_call.append(begin.elapsed_time(end) / 1e3 / calls)
        return sorted(per_call)[len(per_call) // 2]
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < 2000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench_paged(batch, context, args, device, dtype) -> dict:
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
    return dict(op="paged", batch=batch, context=context, ms=paged * 1e3, sdpa_ms=sdpa * 1e3,
                ratio=paged / sdpa, gb_s=kv_bytes / paged / 1e9)


def bench_silu(batch, args, device, dtype) -> dict:
    x = torch.randn(batch, 2 * args.intermediate, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    out = torch.empty(batch, args.intermediate, dtype=dtype, device=device)
    ms = timed(lambda: ops.silu_and_mul(out, x), device, args.min_time) * 1e3
    return dict(op="silu", batch=batch, ms=ms, gb_s=3 * out.numel() * out.element_size() / ms / 1e6)


def bench_prefill(prompt_len, num_cached, args, device, dtype) -> dict:
    """One layer's attention for one prompt: prompt_len new tokens after num_cached prefix-cached ones."""
    h, kvh, d, bs = args.num_heads, args.num_kv_heads, args.head_size, args.block_size
    gen = torch.Generator().manual_seed(0)
    ctx = num_cached + prompt_len
    num_blocks = (ctx + bs - 1) // bs
    qkv = torch.randn(prompt_len, (h + 2 * kvh) * d, generator=gen).to(device, dtype)  # the fused projection
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(-1, h, d), k.view(-1, kvh, d), v.view(-1, kvh, d)
    cache = (torch.randn(num_blocks, kvh, bs, d, generator=gen).to(device, dtype),
             torch.randn(num_blocks, kvh, bs, d, generator=gen).to(device, dtype))
    table = torch.randperm(num_blocks, generator=gen).to(device=device, dtype=torch.int32)
    slots = torch.arange(num_cached, ctx)
    slots = (table.long().cpu()[slots // bs] * bs + slots % bs).to(device)
    span = PrefillSpan(0, prompt_len, ctx, table if num_cached else None)
    meta = AttentionMetadata(slot_mapping=slots, prefills=[span], num_prefill_tokens=prompt_len)
    attn = Attention(h, kvh, d, d ** -0.5)
    ms = timed(lambda: attn(q, k, v, cache, meta), device, args.min_time) * 1e3
    return dict(op="prefill", prompt_len=prompt_len, cached=num_cached, ms=ms)


def bench_quant(name: str, n: int, k: int, rows: int, args) -> dict:
    """One linear of [n, k] in a GGML format (random blocks; Q8_0 goes to q8_gemm through the same blob) at rows."""
    from engine.model_executor.layers.formats import FORMATS, pack_parts, random_raw

    fmt = FORMATS[name]
    blob = pack_parts([(fmt, random_raw(fmt, n, k))])
    dt = linear_dtype(args)
    x, out = torch.randn(rows, k, dtype=dt), torch.empty(rows, n, dtype=dt)
    call = lambda: ops.kquant_gemm(out, x, blob, None)  # noqa: E731
    clock = "thread" if torch.get_num_threads() == 1 else "wall"
    sec = thread_timed(call, args.min_time) if clock == "thread" else timed(call, torch.device("cpu"), args.min_time)
    return dict(op="quant", format=name, n=n, k=k, rows=rows, dtype=str(dt), ms=sec * 1e3,
                gb_s=blob.numel() / sec / 1e9, isa=ops.kquant_gemm_isa(), clock=clock)


def linear_dtype(args) -> torch.dtype:
    """x's and out's dtype for the quantized linears: --dtype (float32 or bfloat16, as a server's --dtype; the
    panels multiply bfloat16 where x and out are and the CPU has AVX-512 BF16)."""
    return torch.float32 if args.dtype == "float16" else getattr(torch, args.dtype)


Q8_PATHS = {"float32": None, "avx2": ops.Q8_GEMM_AVX2, "avx512": ops.Q8_GEMM_AVX512,
            "vnni": ops.Q8_GEMM_VNNI, "x16": ops.Q8_GEMM_X16, "panel": ops.Q8_GEMM_PANEL, "auto": ops.Q8_GEMM_AUTO}


def bench_q8(n: int, k: int, rows: int, paths: list[str], args) -> list[dict]:
    """ops.q8_gemm on a random Q8_0 [n, k] weight at rows, per forced path (those this build and CPU have), and
    torch's float32 linear on the same weight dequantized: ms, GB/s of the weight (packed / float32) and GFLOP/s."""
    from engine.model_executor.layers.quant import pack_q8, quantize_q8_0

    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    packed = pack_q8(*quantize_q8_0(w))
    x = torch.randn(rows, k, generator=gen).to(linear_dtype(args))
    out, wf = torch.empty(rows, n, dtype=x.dtype), w.to(x.dtype)
    clock = "thread" if torch.get_num_threads() == 1 else "wall"
    time_it = (lambda fn: thread_timed(fn, args.min_time)) if clock == "thread" else (
        lambda fn: timed(fn, torch.device("cpu"), args.min_time))
    results = []
    for path in paths:
        isa = Q8_PATHS[path]
        if path == "float32":
            sec, nbytes = time_it(lambda: F.linear(x, wf)), wf.numel() * wf.element_size()
        elif (isa in (ops.Q8_GEMM_AUTO, ops.Q8_GEMM_PANEL) or isa <= ops.q8_gemm_isa()
              or (isa == ops.Q8_GEMM_X16 and ops.q8_gemm_isa() >= ops.Q8_GEMM_AVX2)):
            sec, nbytes = time_it(lambda: ops.q8_gemm(out, x, packed, None, isa)), packed.numel()
        else:
            continue
        results.append(dict(op="q8", path=path, n=n, k=k, rows=rows, dtype=str(x.dtype), ms=sec * 1e3,
                            gb_s=nbytes / sec / 1e9, gflop_s=2 * rows * n * k / sec / 1e9, clock=clock))
    return results


def bench_moe(kinds: list[str], hidden: int, inter: int, experts: int, top_k: int, rows: int, args) -> dict:
    """ops.moe_experts over `experts` random experts of kinds (gate, up, down GGML types; packed as the GGUF loader
    packs them: moe.attach_gguf_experts) at rows, each row's top_k experts distinct and random (seeded)."""
    from engine.model_executor.layers.formats import FORMATS, random_raw
    from engine.model_executor.layers.moe import _stack_parts

    raw = [(FORMATS[kind], random_raw(FORMATS[kind], experts * n, k, seed=i, scale=1e-3))
           for i, (kind, (n, k)) in enumerate(zip(kinds, ((inter, hidden), (inter, hidden), (hidden, inter))))]
    w13, w2 = _stack_parts(raw[:2], experts, inter), _stack_parts(raw[2:], experts, hidden)
    del raw
    gen = torch.Generator().manual_seed(rows)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    weights = torch.full((rows, top_k), 1.0 / top_k)
    x, out = torch.randn(rows, hidden, generator=gen), torch.empty(rows, hidden)
    call = lambda: ops.moe_experts(out, x, ids, weights, w13, w2, inter)  # noqa: E731
    ops.moe_bytes_read(reset=True)
    call()
    nbytes = ops.moe_bytes_read(reset=True)
    clock = "thread" if torch.get_num_threads() == 1 else "wall"
    sec = thread_timed(call, args.min_time) if clock == "thread" else timed(call, torch.device("cpu"), args.min_time)
    return dict(op="moe", types=":".join(kinds), hidden=hidden, inter=inter, experts=experts, top_k=top_k, rows=rows,
                experts_read=len(torch.unique(ids)), ms=sec * 1e3, bytes_read=nbytes, gb_s=nbytes / sec / 1e9,
                clock=clock)


def thread_timed(fn, min_time: float) -> float:
    """Least CPU seconds of the calling thread per call over 7 windows of ~min_time / 7 (one thread: the kernel's own
    work, which a shared machine's other processes do not stretch as they stretch the wall clock)."""
    fn()
    best = float("inf")
    for _ in range(7):
        start, calls = time.thread_time(), 0
        while time.thread_time() - start < min_time / 7:
            fn()
            calls += 1
        best = min(best, (time.thread_time() - start) / calls)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="paged", help="comma-separated: paged, silu, prefill, quant, q8, moe")
    p.add_argument("--formats", default="Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q4_K,Q5_K,Q6_K", help="quant: GGML types")
    p.add_argument("--quant-rows", type=int, nargs="*", default=[1, 8])
    p.add_argument("--q8-paths", default="avx2,panel,float32",
                   help=f"q8: q8_gemm paths forced ({', '.join(Q8_PATHS)}; float32: torch's linear in --dtype)")
    p.add_argument("--q8-shapes", nargs="*", default=["2048x2048", "2048x8192", "8192x2048"], help="q8: NxK")
    p.add_argument("--q8-rows", type=int, nargs="*", default=[1, 4, 8, 32, 128, 512])
    p.add_argument("--moe-types", nargs="*", default=["Q4_K:Q4_K:Q6_K", "Q4_K:Q4_K:Q4_K", "Q8_0:Q8_0:Q8_0"],
                   help="moe: gate:up:down GGML types per run")
    p.add_argument("--moe-shape", default="2048x768x32x8", help="moe: hidden x intermediate x experts x top-k")
    p.add_argument("--moe-rows", type=int, nargs="*", default=[1, 8])
    p.add_argument("--full", action="store_true", help="batch 1..256 x context 128..4096")
    p.add_argument("--batches", type=int, nargs="*")
    p.add_argument("--contexts", type=int, nargs="*")
    p.add_argument("--prompt-lens", type=int, nargs="*", default=[16, 128, 512])
    p.add_argument("--cached", action="store_true", help="prefill also with a prefix-cached first half")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M shapes: 9/3 heads x 64, intermediate 1536")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--min-time", type=float, default=0.2, help="seconds of repeats per measurement")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kernels.json"))
    args = p.parse_args()
    if args.smollm2:
        args.num_heads, args.num_kv_heads, args.head_size, args.intermediate = 9, 3, 64, 1536

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    small = device.type == "cpu" and not args.full
    batches = args.batches or ([1, 8, 32] if small else FULL_BATCHES)
    contexts = args.contexts or ([128, 512, 1024] if small else FULL_CONTEXTS)
    wanted = args.ops.split(",")

    backend = ops.backend()
    print(f"device: {device_name(device)}  backend: {backend.value}  dtype: {args.dtype}  "
          f"heads {args.num_heads}/{args.num_kv_heads} x {args.head_size}, block {args.block_size}")
    rows = []
    if "paged" in wanted:
        print(f"{'batch':>6} {'context':>8} {'paged ms':>10} {'sdpa ms':>10} {'paged/sdpa':>11} {'KV GB/s':>9}")
        for batch in batches:
            for context in contexts:
                r = bench_paged(batch, context, args, device, dtype)
                rows.append(r)
                print(f"{r['batch']:>6} {r['context']:>8} {r['ms']:>10.4f} {r['sdpa_ms']:>10.4f} "
                      f"{r['ratio']:>11.2f} {r['gb_s']:>9.1f}", flush=True)
    if "silu" in wanted:
        shapes = f"[batch, {2 * args.intermediate}] -> [batch, {args.intermediate}]"
        print(f"{'batch':>6} {'silu ms':>10} {'GB/s':>7}   {shapes}")
        for batch in batches:
            rows.append(r := bench_silu(batch, args, device, dtype))
            print(f"{batch:>6} {r['ms']:>10.4f} {r['gb_s']:>7.1f}", flush=True)
    if "prefill" in wanted:
        print(f"{'prompt':>6} {'cached':>6} {'prefill ms':>10}   one layer's Attention.forward")
        for n in args.prompt_lens:
            for cached in ([0, n // 2] if args.cached else [0]):
                rows.append(r := bench_prefill(n - cached, cached, args, device, dtype))
                print(f"{n - cached:>6} {cached:>6} {r['ms']:>10.4f}", flush=True)

    if "quant" in wanted:
        print(f"{'format':>6} {'N x K':>11} {'rows':>5} {'ms':>9} {'GB/s':>7}   kquant_gemm path {ops.kquant_gemm_isa()}")
        for n, k in ((2048, 8192), (8192, 2048)):
            for name in args.formats.split(","):
                for m in args.quant_rows:
                    rows.append(r := bench_quant(name, n, k, m, args))
                    print(f"{name:>6} {f'{n}x{k}':>11} {m:>5} {r['ms']:>9.3f} {r['gb_s']:>7.2f}", flush=True)
    if "q8" in wanted:
        print(f"{'N x K':>11} {'rows':>5} {'path':>10} {'ms':>9} {'GB/s':>7} {'GFLOP/s':>8}   q8_gemm best path "
              f"{ops.q8_gemm_isa()}, {torch.get_num_threads()} threads")
        for shape in args.q8_shapes:
            n, k = (int(v) for v in shape.split("x"))
            for m in args.q8_rows:
                for r in bench_q8(n, k, m, args.q8_paths.split(","), args):
                    rows.append(r)
                    print(f"{shape:>11} {m:>5} {r['path']:>10} {r['ms']:>9.3f} {r['gb_s']:>7.2f} {r['gflop_s']:>8.1f}",
                          flush=True)
    if "moe" in wanted:
        hidden, inter, experts, top_k = (int(v) for v in args.moe_shape.split("x"))
        print(f"{'types':>15} {'rows':>5} {'experts':>7} {'ms':>9} {'MiB read':>9} {'GB/s':>7}   moe_experts "
              f"{args.moe_shape}, kquant_gemm path {ops.kquant_gemm_isa()}, {torch.get_num_threads()} threads")
        for kinds in args.moe_types:
            for m in args.moe_rows:
                rows.append(r := bench_moe(kinds.split(":"), hidden, inter, experts, top_k, m, args))
                print(f"{kinds:>15} {m:>5} {r['experts_read']:>7} {r['ms']:>9.3f} {r['bytes_read'] / 2**20:>9.1f} "
                      f"{r['gb_s']:>7.2f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=device_name(device), backend=backend.value, dtype=args.dtype, num_heads=args.num_heads,
                num_kv_heads=args.num_kv_heads, head_size=args.head_size, block_size=args.block_size,
                intermediate=args.intermediate, torch=torch.__version__)
    out.write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
