"""What a decode step's calls cost beside its math: the eager layers, the compiled layer loop, and torch.compile.

Builds random-weight Llama models of 30 layers (no download): "tiny" (hidden 64, one head) where the kernels'
work is next to nothing, so a step's time is its calls, and "smollm2" (SmolLM2-135M's shape). Times one decode
forward at --batch sequences (context --context) with the eager layers (--enforce-eager's path) and with the
compiled layer loop (csrc/cpu/decode_layers.cpp). --torch-compile also times the tiny model's layer loop written
over the csrc ops registered as torch.library custom ops, eagerly and under torch.compile (inductor, and inductor
with its C++ wrapper): the other way issue 16 named to remove the Python between the kernels.

    .venv/bin/python benchmarks/decode_overhead.py                      # float32, batch 1, 2 threads
    .venv/bin/python benchmarks/decode_overhead.py --dtype bfloat16 --batch 8
    .venv/bin/python benchmarks/decode_overhead.py --torch-compile     # + torch.compile (~90 s of compiling)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.platform.openmp import apply_serving_default  # noqa: E402  (no torch import)

apply_serving_default()  # as `pagedserve serve` does, before torch loads libgomp

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

LAYERS = 30
SHAPES = {  # hidden, intermediate, heads, kv heads, vocab
    "tiny": (64, 128, 1, 1, 256),
    "smollm2": (576, 1536, 9, 3, 49152),
}
HEAD_DIM, BLOCK = 64, 16


def build(shape: str, dtype: torch.dtype, batch: int, context: int):
    """(model, forward(), its decode inputs) for one decode step of `batch` sequences at `context` tokens."""
    from transformers import LlamaConfig

    from engine.model_executor.layers.attention import AttentionMetadata
    from engine.model_executor.layers.cpu_linear import pack_linears
    from engine.model_executor.models.llama import LlamaForCausalLM

    hidden, inter, heads, kv_heads, vocab = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=LAYERS,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(config, dtype=dtype, max_len=2048)
    model.init_dummy_weights(0)
    pack_linears(model)
    per_seq = context // BLOCK + 1
    caches = [tuple(torch.zeros(batch * per_seq, kv_heads, BLOCK, HEAD_DIM, dtype=dtype) for _ in range(2))
              for _ in range(LAYERS)]
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    slots = (tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK)
    meta = AttentionMetadata(slot_mapping=slots, decode_block_tables=tables,
                             decode_context_lens=torch.full((batch,), context, dtype=torch.int32))
    ids = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(0))
    positions = torch.full((batch,), context - 1)
    inputs = dict(ids=ids, positions=positions, caches=caches, meta=meta)

    def forward():
        return model.compute_logits(model(ids, positions, caches, meta))

    return model, forward, inputs


def median_ms(fn, reps: int) -> float:
    with torch.inference_mode():
        for _ in range(5):
            fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def eager_against_compiled(shape: str, dtype: torch.dtype, batch: int, context: int, reps: int) -> dict:
    model, forward, _ = build(shape, dtype, batch, context)
    result = {}
    for _ in range(3):  # alternate, so a noisy neighbour hits both alike
        for compiled in (False, True):
            model.compiled_decode = compiled
            key = "compiled_ms" if compiled else "eager_ms"
            result[key] = min(result.get(key, float("inf")), median_ms(forward, reps))
    with torch.inference_mode():
        model.compiled_decode = False
        eager = forward()
        model.compiled_decode = True
        assert torch.equal(eager, forward()), "the compiled loop must give the eager logits bit for bit"
    return result


def torch_compile_variants(dtype: torch.dtype, batch: int, context: int, reps: int) -> dict:
    """The tiny model's layer loop over the csrc ops as torch.library custom ops: eager, torch.compile'd, and
    torch.compile'd with inductor's C++ wrapper. Returns median ms and first-call (compile) seconds."""
    from engine import ops

    m = ops._load()
    lib = "pagedserve_bench"

    @torch.library.custom_op(f"{lib}::rms_norm", mutates_args=())
    def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
        out = torch.empty_like(x)
        m.rms_norm(out, x, w, eps)
        return out

    rms_norm.register_fake(lambda x, w, eps: torch.empty_like(x))

    @torch.library.custom_op(f"{lib}::add_rms_norm", mutates_args=("x", "residual"))
    def add_rms_norm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> None:
        m.fused_add_rms_norm(x, residual, w, eps)

    add_rms_norm.register_fake(lambda x, residual, w, eps: None)

    @torch.library.custom_op(f"{lib}::small_gemm", mutates_args=())
    def small_gemm(x: Tensor, packed: Tensor, n: int) -> Tensor:
        out = x.new_empty(x.shape[0], n)
        m.small_gemm(out, x, packed, None, 0)
        return out

    small_gemm.register_fake(lambda x, packed, n: x.new_empty(x.shape[0], n))

    @torch.library.custom_op(f"{lib}::attend", mutates_args=("key_cache", "value_cache"))
    def attend(qkv: Tensor, positions: Tensor, cos_sin: Tensor, key_cache: Tensor, value_cache: Tensor,
               slots: Tensor, tables: Tensor, lens: Tensor, heads: int, kv_heads: int, scale: float) -> Tensor:
        t = qkv.shape[0]
        qkv = qkv.clone()
        qk = qkv[:, :(heads + kv_heads) * HEAD_DIM].view(t, heads + kv_heads, HEAD_DIM)
        m.rotary_embedding(positions, qk, cos_sin)
        v = qkv[:, (heads + kv_heads) * HEAD_DIM:].view(t, kv_heads, HEAD_DIM)
        m.reshape_and_cache(qk[:, heads:], v, key_cache, value_cache, slots)
        out = qkv.new_empty(t, heads, HEAD_DIM)
        m.paged_attention(out, qk[:, :heads], key_cache, value_cache, tables, lens, scale, 0)
        return out.view(t, heads * HEAD_DIM)

    attend.register_fake(lambda qkv, *a: qkv.new_empty(qkv.shape[0], a[-3] * HEAD_DIM))

    @torch.library.custom_op(f"{lib}::silu_mul", mutates_args=())
    def silu_mul(x: Tensor) -> Tensor:
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        m.silu_and_mul(out, x)
        return out

    silu_mul.register_fake(lambda x: x.new_empty(x.shape[0], x.shape[1] // 2))

    model, _, inp = build("tiny", dtype, batch, context)
    hidden, inter, heads, kv_heads, _ = SHAPES["tiny"]
    weights = model.compiled_plan().weights
    cos_sin = model.rotary.table(torch.device("cpu"))
    meta, kcs, vcs = inp["meta"], [c[0] for c in inp["caches"]], [c[1] for c in inp["caches"]]
    eps, scale = model.args.rms_norm_eps, HEAD_DIM ** -0.5

    def layers(x, positions, slots, tables, lens, kcs, vcs):
        residual = x
        x = rms_norm(x, weights[0], eps)
        n = ops.decode_layer_slots()  # csrc/cpu/decode_layers.cpp's Slot: input norm 0, qkv 1, o 5, pre-MLP norm 8,
        for layer in range(LAYERS):  # gate_up 9, down 11 (a Llama fills no other slot)
            w = weights[layer * n:(layer + 1) * n]
            if layer:
                add_rms_norm(x, residual, w[0], eps)
            qkv = small_gemm(x, w[1], (heads + 2 * kv_heads) * HEAD_DIM)
            a = attend(qkv, positions, cos_sin, kcs[layer], vcs[layer], slots, tables, lens, heads, kv_heads, scale)
            x = small_gemm(a, w[5], hidden)
            add_rms_norm(x, residual, w[8], eps)
            x = small_gemm(silu_mul(small_gemm(x, w[9], 2 * inter)), w[11], hidden)
        return residual + x

    x0 = model.embed(inp["ids"])
    args = (inp["positions"], meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, kcs, vcs)
    out = {"custom_ops_eager_ms": median_ms(lambda: layers(x0.clone(), *args), reps)}
    import torch._inductor.config as inductor_config

    for key, cpp_wrapper in (("torch_compile", False), ("torch_compile_cpp_wrapper", True)):
        inductor_config.cpp_wrapper = cpp_wrapper
        torch._dynamo.reset()
        fn = torch.compile(layers, fullgraph=True, dynamic=False)
        start = time.perf_counter()
        with torch.inference_mode():
            fn(x0.clone(), *args)
        out[f"{key}_first_call_s"] = time.perf_counter() - start
        out[f"{key}_ms"] = median_ms(lambda: fn(x0.clone(), *args), reps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--shapes", default="tiny,smollm2")
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine import ops

    if ops.backend() is not ops.OpsBackend.COMPILED_CPU:
        sys.exit("needs the compiled CPU ops (engine/ops/build.py)")
    dtype = getattr(torch, args.dtype)
    report = {"dtype": args.dtype, "batch": args.batch, "context": args.context, "layers": LAYERS,
              "threads": torch.get_num_threads(), "omp_env": {k: v for k, v in os.environ.items() if "OMP" in k}}
    for shape in args.shapes.split(","):
        r = report[shape] = eager_against_compiled(shape, dtype, args.batch, args.context, args.reps)
        print(f"{shape:8s} decode forward, batch {args.batch}, {args.dtype}, {report['threads']} threads: "
              f"eager {r['eager_ms']:.2f} ms, compiled layer loop {r['compiled_ms']:.2f} ms "
              f"(saves {r['eager_ms'] - r['compiled_ms']:.2f} ms a step)", flush=True)
    if args.torch_compile:
        r = report["tiny_torch_compile"] = torch_compile_variants(dtype, args.batch, args.context, args.reps)
        print(f"tiny     custom ops eager {r['custom_ops_eager_ms']:.2f} ms; torch.compile {r['torch_compile_ms']:.2f} ms "
              f"(first call {r['torch_compile_first_call_s']:.0f} s); with inductor's C++ wrapper "
              f"{r['torch_compile_cpp_wrapper_ms']:.2f} ms (first call {r['torch_compile_cpp_wrapper_first_call_s']:.0f} s)")
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
