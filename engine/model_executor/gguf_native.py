"""A quantized GGUF file served as it is (issues 42, 53): each linear's blocks, in whatever GGML type the file holds
them (a Q4_K_M file: Q4_K for most linears, Q6_K for the head, attn_v and half of ffn_down, Q5_0 / Q8_0 where a row is
not a multiple of 256), go to the weight-format registry's kernel without ever becoming floats, so pagedserve
multiplies the numbers llama.cpp multiplies.

Which files: a GGUF of any family the decoder serves (engine/model_executor/gguf_file.py ARCHS: llama, qwen2, qwen3,
gemma3, phi3, qwen3moe, qwen2moe) with at least one quantized linear, on CPU, one rank (engine/model_executor/loader.py
decides; CUDA, tensor parallelism and `--quantization none` still go through transformers' dequantization). The
fused linears take their parts in their own formats (qkv_proj = q | k | v with v Q6_K and q, k Q4_K; Phi-3's file
holds qkv and gate_up fused, one part each). A type without a kernel here (Q2_K, Q3_K, IQ*) or a float 2-D weight is
dequantized a chunk of rows at a time and held as Q8_0, with a warning naming the type: never refused. A mixture of
experts' experts (ffn_*_exps, [E, rows, K]) go to csrc/cpu/moe.cpp in their own blocks too (a Q4_K_M file's Q4_K
gate / up and Q6_K or Q4_K down: one packed blob an expert, as a dense linear's; a type without a kernel held as
Q8_0 the same way). Gemma's norms are stored as 1 + w by llama.cpp's converter:
shifted back (gguf_file.vector_tensors) and the decoder adds its norm_offset, as for an HF checkpoint.

The linears are read with plain file reads, one tensor at a time (one over formats.PACK_CHUNK_BYTES a chunk of rows at a
time, gguf_file.FileRows, as it is packed), not through a memory map: the registry repacks them, and mapped pages once
read stay in the process's resident set until the map closes (the whole file at the load's peak). The token embedding
(tied or not) is the exception: a step gathers a few of its rows, so it stays in a read-only map of the file, as
llama.cpp's mmap, and only the rows gathered are dequantized (layers/ggml_linears.py attach_block_embedding); a tied
head reads the same tensor into its own packed copy.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from engine.model_executor.gguf_file import (ARCHS, FLOAT_TYPES, FileRows, _Info, header, hf_name, is_linear,
                                             map_rows, read_bytes, unpermute_rows, vector_tensors)
from engine.model_executor.layers import formats
from engine.model_executor.layers.cpu_linear import _trim_heap
from engine.model_executor.layers.ggml_linears import (attach_block_embedding, registry_format, rows_dequantizer,
                                                       warn_dequantized)
from engine.model_executor.layers.ggml_quantize import quantize_rows

logger = logging.getLogger(__name__)

HELD_AS = "Q8_0"  # a linear whose type has no kernel here: dequantized, then these blocks
REQUANT_CHUNK_WEIGHTS = 1 << 20  # weights dequantized at a time on the way to HELD_AS


def linear_types(path: Path) -> set[str]:
    """The GGML types of a Llama-family GGUF's linear weights (empty: not a GGUF this module reads, or another
    architecture)."""
    try:
        arch, infos = header(path)
    except Exception:  # not a GGUF gguf-py reads: transformers' loader reports it
        return set()
    return {i.kind for i in infos if is_linear(i)} if arch in ARCHS else set()


def is_native_gguf(path: Path) -> bool:
    """This GGUF can be served from its blocks: a Llama-family file with a quantized linear, and this CPU runs the
    registry's kernels (Q8_0 at least: the type every other one falls back to)."""
    kinds = linear_types(path)
    return bool(kinds - set(FLOAT_TYPES)) and registry_format(HELD_AS).native()


def _requantized(raw: torch.Tensor, info: _Info) -> torch.Tensor:
    """A tensor whose type has no kernel here (raw uint8 [N, row_bytes]) as HELD_AS blocks, a chunk of rows at a
    time: the float temporaries stay ~4 MiB."""
    n, k = info.shape
    if k % 32:
        raise ValueError(f"GGUF tensor {info.name} ({info.kind} [{n}, {k}]): no kernel, and rows of {k} weights "
                         f"cannot be held as {HELD_AS}")
    dequantize = rows_dequantizer(info.kind, k)
    out = None
    step = max(1, REQUANT_CHUNK_WEIGHTS // k)
    for r in range(0, n, step):
        blocks = quantize_rows(dequantize(raw[r:r + step]), HELD_AS)  # [rows, k / 32 * 34]
        if out is None:
            out = torch.empty(n, blocks.shape[1], dtype=torch.uint8)
        out[r:r + step] = blocks
    return out


def _expert_blocks(raw: torch.Tensor, info: _Info, dequantized: dict[str, list[str]]
                   ) -> tuple[formats.WeightFormat, torch.Tensor]:
    """A mixture of experts' 3-D tensor [E, rows, K] (raw uint8, expert-major) as (format, raw uint8 [E * rows,
    row_bytes]): in its own blocks where the registry has a kernel for its type (csrc/cpu/moe.cpp runs each expert
    through q8_gemm or kquant_gemm); another type (Q2_K, Q3_K, IQ*, a float type) dequantized and held as HELD_AS,
    with the warning."""
    e, n, k = info.shape
    raw = raw.view(e * n, -1)
    fmt = registry_format(info.kind)
    if fmt is None or not fmt.native():
        dequantized.setdefault(info.kind, []).append(info.name)
        raw = _requantized(raw, _Info(info.name, info.kind, (e * n, k), info.offset, info.nbytes))
        fmt = registry_format(HELD_AS)
    return fmt, raw


def _targets(model: nn.Module, arch: str, tied: bool) -> list[tuple[nn.Module, list[str]]]:
    """Each linear of the model with the HF names of the file tensors that make its rows, in order (Phi-3's
    qkv_proj and gate_up_proj are one tensor each in the file, as in HF; the others' parts q | k | v, gate | up).
    A mixture of experts' layer has no MLP linears here (_attach_experts)."""
    fused = arch == "phi3"
    targets: list[tuple[nn.Module, list[str]]] = []
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [p + "self_attn.qkv_proj"] if fused else [p + f"self_attn.{x}_proj" for x in "qkv"]
        targets += [(attn.qkv_proj, qkv), (attn.o_proj, [p + "self_attn.o_proj"])]
        if hasattr(mlp, "gate_up_proj"):
            gate_up = [p + "mlp.gate_up_proj"] if fused else [p + "mlp.gate_proj", p + "mlp.up_proj"]
            targets += [(mlp.gate_up_proj, gate_up), (mlp.down_proj, [p + "mlp.down_proj"])]
        elif getattr(mlp, "shared_expert", None) is not None:  # Qwen2-MoE's shared expert: a dense MLP's linears
            s = p + "mlp.shared_expert."
            targets += [(mlp.shared_expert.gate_up_proj, [s + "gate_proj", s + "up_proj"]),
                        (mlp.shared_expert.down_proj, [s + "down_proj"])]
    targets.append((model.lm_head, ["model.embed_tokens" if tied else "lm_head"]))
    return targets


@torch.no_grad()
def load_native_gguf(model: nn.Module, path: Path, hf_config, dtype: torch.dtype) -> dict[str, int]:
    """Load a quantized GGUF (is_native_gguf) into `model` (the decoder of any family in ARCHS, params allocated, not
    loaded): the norms, biases and a router as floats through model.load_weights, every linear as its file blocks
    (formats.attach_quantized_linear), a mixture of experts' experts likewise (moe.attach_gguf_experts), the token
    embedding from a map of the file; the float weights released before anything is read. Returns how many linear
    tensors each type holds (after any fallback; experts count as one tensor each of gate, up, down)."""
    from engine.model_executor.layers.moe import attach_gguf_experts

    arch, infos = header(path)
    by_hf = {hf_name(i.name, arch): i for i in infos}
    tied = "lm_head.weight" not in by_hf
    targets = _targets(model, arch, tied)
    moe = [layer.mlp for layer in model.layers if not hasattr(layer.mlp, "gate_up_proj")]
    # The linears', experts' and embedding's float weights are never read: released before the norms load, so
    # load_weights expects no rows for them (and the model never holds them).
    for module in [m for m, _ in targets] + [model.embed_tokens]:
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    for mlp in moe:
        mlp.w13 = nn.Parameter(mlp.w13.new_empty(0), requires_grad=False)
        mlp.w2 = nn.Parameter(mlp.w2.new_empty(0), requires_grad=False)
    model.load_weights(vector_tensors(path, infos, arch, hf_config))
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    counts: dict[str, int] = {}
    dequantized: dict[str, list[str]] = {}

    def info_of(name: str, dims: int = 2) -> _Info:
        info = by_hf.get(name + ".weight")
        if info is None or len(info.shape) != dims:
            raise ValueError(f"{path.name} has no {dims}-D tensor for {name}.weight")
        return info

    with open(path, "rb") as f:
        def part(name: str) -> tuple[formats.WeightFormat, torch.Tensor]:
            """One tensor's rows as (format, raw uint8 [rows, row_bytes]) in HF's row order."""
            info = info_of(name)
            fmt = registry_format(info.kind)
            kind = name.rsplit(".", 1)[-1]
            permuted = arch == "llama" and kind in heads  # q / k rows: llama.cpp's RoPE order undone
            if fmt is not None and fmt.native() and info.nbytes > formats.PACK_CHUNK_BYTES and not permuted:
                raw = FileRows(f, info, info.nbytes // info.shape[0])  # packed a chunk of rows at a time
            else:
                raw = read_bytes(f, info).view(info.shape[0], -1)
                if fmt is None:
                    dequantized.setdefault(info.kind, []).append(info.name)
                    raw, fmt = _requantized(raw, info), registry_format(HELD_AS)
                if permuted:
                    raw = raw[unpermute_rows(raw.shape[0], heads[kind])]
            counts[fmt.name] = counts.get(fmt.name, 0) + 1
            return fmt, raw

        for module, names in targets:
            shapes = [info_of(n).shape for n in names]
            if sum(s[0] for s in shapes) != module.out_features or any(s[1] != module.in_features for s in shapes):
                raise ValueError(f"{path.name}: {names} hold {shapes} weights, the model's linear is "
                                 f"[{module.out_features}, {module.in_features}]")
            formats.attach_quantized_linear(module, [part(n) for n in names])
            _trim_heap()  # each module's transient copies back to the OS: the load's peak stays near the weights
        for i, layer in enumerate(model.layers):
            if layer.mlp in moe:
                experts = []
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    info = info_of(f"model.layers.{i}.mlp.experts.{proj}", 3)
                    experts.append(_expert_blocks(read_bytes(f, info), info, dequantized))
                    counts[experts[-1][0].name] = counts.get(experts[-1][0].name, 0) + 1
                attach_gguf_experts(layer.mlp, *experts)
                del experts
                _trim_heap()
    emb_info = info_of("model.embed_tokens")
    if tuple(emb_info.shape) != (model.embed_tokens.num_embeddings, model.embed_tokens.embedding_dim):
        raise ValueError(f"{path.name}: token_embd is {emb_info.shape}, the model's embedding "
                         f"[{model.embed_tokens.num_embeddings}, {model.embed_tokens.embedding_dim}]")
    rows, release = map_rows(path, emb_info)
    attach_block_embedding(model.embed_tokens, rows, emb_info.kind, dtype, release)
    for kind, names in dequantized.items():
        if kind not in FLOAT_TYPES:
            warn_dequantized(kind, names, HELD_AS)
    logger.info("loaded %s's weights as their GGUF blocks (%s), not dequantized", path.name,
                ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return counts
