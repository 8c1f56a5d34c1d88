"""How fast a decode step's linears stream their weights: the small-row kernel against oneDNN and a plain copy.

A decode step reads every weight once: SmolLM2-135M's 30 layers of four linears (qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576), each layer with its own weights (cold, as in a forward), and the LM head
(576->49152, the largest single read). Per row count (1, 2, 4, 8, 16) this times one sweep of them with

- small: csrc/cpu/small_gemm.cpp over weights packed by engine/model_executor/layers/cpu_linear.py's pack_small_rows;
- onednn: the packed oneDNN linear (torch.ops.mkldnn._linear_pointwise) pagedserve used before;

and reports the weight bytes read per second (GB/s, median of repeats), next to a plain copy of a buffer of the
same size (torch's copy_, read + write bytes per second: what the memory moves with both cores).

    .venv/bin/python benchmarks/small_gemm.py --dtype bfloat16 --output-json benchmarks/results/small_gemm_bf16.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.platform.openmp import apply_serving_default  # noqa: E402  (no torch import)

apply_serving_default()  # as `pagedserve serve` does, before torch loads libgomp
import torch  # noqa: E402

from engine import ops  # noqa: E402
from engine.model_executor.layers.cpu_linear import pack_small_rows  # noqa: E402
from kernels import timed  # noqa: E402  (benchmarks/kernels.py: median seconds per call)

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
HEAD_SHAPE = (576, 49152)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of repeats per measurement")
    p.add_argument("--isa", type=int, default=ops.SMALL_GEMM_AUTO, help="force a small_gemm path (2, 3, 4)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)

    shapes = [s for _ in range(args.layers) for s in LAYER_SHAPES] + [HEAD_SHAPE]
    weights = [(torch.randn(o, i, generator=gen) * 0.02).to(dtype) for i, o in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    small = [pack_small_rows(w) for w in weights]
    # oneDNN packs bfloat16 only with AVX-512 (or AVX-NE-CONVERT): on an AVX2-only CPU only the kernel is timed.
    with_onednn = dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights] if with_onednn else []
    del weights

    src = torch.empty(weight_bytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    copy_s = timed(lambda d=dst, s=src: d.copy_(s), cpu, args.min_time)
    copy_gbs = 2 * weight_bytes / copy_s / 1e9
    del src, dst
    print(f"{_cpu_name()}, {args.threads} threads, {args.dtype}, {weight_bytes / 2**20:.0f} MiB of weights "
          f"(30 layers + head); small_gemm ISA path {args.isa or ops.small_gemm_isa()}")
    print(f"plain copy: {copy_gbs:.1f} GB/s (read + write)")

    results = []
    for rows in args.rows:
        xs = {i: torch.randn(rows, i, generator=gen).to(dtype) for i, _ in shapes}
        outs = [torch.empty(rows, o, dtype=dtype) for _, o in shapes]

        def run_small():
            for (i, _), w, out in zip(shapes, small, outs):
                ops.small_gemm(out, xs[i], w, None, args.isa)

        def run_onednn():
            for (i, _), w in zip(shapes, onednn):
                torch.ops.mkldnn._linear_pointwise(xs[i], w, None, "none", [None], "")

        row = {"rows": rows}
        for name, fn in (("small", run_small), ("onednn", run_onednn))[: 2 if with_onednn else 1]:
            seconds = timed(fn, cpu, args.min_time)
            row[f"{name}_ms"] = round(seconds * 1e3, 3)
            row[f"{name}_gbs"] = round(weight_bytes / seconds / 1e9, 2)
        line = f"rows {rows:2d}: small {row['small_ms']:7.2f} ms {row['small_gbs']:6.1f} GB/s"
        if with_onednn:
            row["speedup"] = round(row["onednn_ms"] / row["small_ms"], 2)
            line += f" | oneDNN {row['onednn_ms']:7.2f} ms {row['onednn_gbs']:6.1f} GB/s | {row['speedup']:.2f}x"
        results.append(row)
        print(line)

    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps({
            "cpu": _cpu_name(), "threads": args.threads, "dtype": args.dtype, "weight_mib": weight_bytes / 2**20,
            "isa": args.isa or ops.small_gemm_isa(), "copy_gbs": round(copy_gbs, 2), "results": results,
        }, indent=2))


if __name__ == "__main__":
    main()
