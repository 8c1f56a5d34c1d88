"""The CPU GEMM rates that bound a decode step and a prefill: SmolLM2-135M's 30 layers of linears.

Each layer has its own weights (cold: what a forward sees), or one layer's weights serve all 30 calls
(--hot). Per row count it times one sweep of the four linears of every layer (qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576) with each library torch offers on CPU, and prints GFLOP/s (median of
repeats):

- onednn: the packed oneDNN linear pagedserve uses (engine/model_executor/layers/cpu_linear.py);
- f_linear: F.linear (MKL sgemm, repacking the weight per call);
- mkl_packed: MKL's packed sgemm (float32 only);
- int8: oneDNN u8 x s8 with per-channel weight scales and a float32 output, the W8A8 route (the inputs
  are random integers: a rate, not a numerics check).

    .venv/bin/python benchmarks/cpu_gemm.py --threads 1 --rows 16 32 128
    .venv/bin/python benchmarks/cpu_gemm.py --threads 2 --dtype bfloat16 --libs onednn,f_linear
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.platform.openmp import apply_serving_default  # noqa: E402  (no torch import)

apply_serving_default()  # as `pagedserve serve` does, before torch loads libgomp
import torch  # noqa: E402

from kernels import timed  # noqa: E402  (benchmarks/kernels.py: median seconds per call)

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of qkv, o, gate_up, down
LIBS = ("onednn", "f_linear", "mkl_packed", "int8")


def sweep(lib: str, rows: int, layers: int, weights: list[list[torch.Tensor]], dtype: torch.dtype):
    """A closure running every layer's four linears once with `lib`, or None if it does not apply."""
    xs = [torch.randn(rows, i, dtype=dtype) for i, _ in SHAPES]

    def w(layer: int) -> list[torch.Tensor]:  # --hot: one layer's weights serve every layer
        return weights[layer % len(weights)]

    if lib == "onednn":
        packed = [[torch.ops.mkldnn._reorder_linear_weight(t, None) for t in ws] for ws in weights]
        return lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")
                        for layer in range(layers) for x, p in zip(xs, packed[layer % len(packed)])]
    if lib == "f_linear":
        return lambda: [torch.nn.functional.linear(x, t) for layer in range(layers) for x, t in zip(xs, w(layer))]
    if lib == "mkl_packed":
        if dtype != torch.float32 or not hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
            return None  # MKL's packed sgemm: float32, and only in torch builds with MKL
        packed = [[torch.ops.mkl._mkl_reorder_linear_weight(t, rows) for t in ws] for ws in weights]
        return lambda: [torch.ops.mkl._mkl_linear(x, p, t, None, rows) for layer in range(layers)
                        for x, p, t in zip(xs, packed[layer % len(packed)], w(layer))]
    if lib == "int8":
        if "onednn" not in torch.backends.quantized.supported_engines:
            return None
        qws = [[(torch.ops.onednn.qlinear_prepack(torch.randint(-127, 128, t.shape, dtype=torch.int8), [rows, t.shape[1]]),
                 torch.full((t.shape[0],), 0.01), torch.zeros(t.shape[0], dtype=torch.int64)) for t in ws]
               for ws in weights]
        qxs = [torch.randint(0, 256, (rows, i), dtype=torch.uint8) for i, _ in SHAPES]
        return lambda: [torch.ops.onednn.qlinear_pointwise(x, 0.02, 128, q, s, z, None, 1.0, 0, torch.float32,
                                                           "none", [], "")
                        for layer in range(layers) for x, (q, s, z) in zip(qxs, qws[layer % len(qws)])]
    raise ValueError(lib)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 128])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hot", action="store_true", help="one layer's weights for every call (cache-resident)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of repeats per measurement (median)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [[torch.randn(o, i, dtype=dtype) * 0.05 for i, o in SHAPES] for _ in range(1 if args.hot else args.layers)]
    results = []
    for rows in args.rows:
        gflop = 2 * rows * sum(i * o for i, o in SHAPES) * args.layers / 1e9
        line = []
        for lib in args.libs.split(","):
            fn = sweep(lib, rows, args.layers, weights, dtype)
            if fn is None:
                continue
            with torch.inference_mode():
                seconds = timed(fn, torch.device("cpu"), args.min_time)
            results.append({"lib": lib, "rows": rows, "ms": seconds * 1e3, "gflops": gflop / seconds})
            line.append(f"{lib} {seconds * 1e3:.1f} ms ({gflop / seconds:.0f} GFLOP/s)")
        print(f"rows {rows}, {args.layers} layers ({'hot' if args.hot else 'cold'}), {args.threads} threads, "
              f"{args.dtype}: " + ", ".join(line), flush=True)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
