"""A GGUF file whose weights are Q8_0, served as it is: its int8 blocks go into csrc/cpu/q8_gemm.cpp's layout
without ever being dequantized (issue 42), so pagedserve multiplies the numbers llama.cpp multiplies.

Which files: a Llama-family GGUF (architecture llama or qwen2) whose every linear weight (attention, MLP, the head
when it has one) is Q8_0, on CPU, one rank; the token embedding too when it is Q8_0 (else it is quantized at load).
Any other GGUF is dequantized to float by transformers, as before (engine/model_executor/loader.py).

The linears are read with plain file reads, one at a time, not through a memory map: they are repacked into
csrc/cpu/q8_gemm.cpp's layout, and mapped pages once read stay in the process's resident set until the map closes,
the whole file at the load's peak. An untied Q8_0 token embedding is the exception: it is used as the file lays it out
(a step gathers a few rows), so it stays in a read-only map of the file, as llama.cpp's mmap (its ~100 MiB at 1B
shapes never packed into anonymous memory), and the pages a lookup mapped are let go after it (gguf_file.map_rows's release).
The file must then stay in place, unchanged, while it is served (as for llama.cpp).
llama.cpp's converter reorders the rows of q_proj and k_proj for its RoPE (per head, the two halves interleaved);
a row of Q8_0 holds its own blocks, so the rows are put back in HF's order exactly (transformers' reverse_permute).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from engine.model_executor.gguf_file import (LINEAR_PARTS, Q8_ARCHS, _Info, header as _infos, hf_name, map_rows,
                                             read_bytes, unpermute_rows)
from engine.model_executor.layers.cpu_linear import _trim_heap
from engine.model_executor.layers.quant import (COLS, QK, attach_q8_embedding,
                                                attach_q8_file_embedding, attach_q8_linear, pack_q8, q8_numel,
                                                quantize_q8_0)

logger = logging.getLogger(__name__)

READ_CHUNK_BYTES = 4 << 20  # a Q8_0 tensor is read and packed this many bytes at a time, into one buffer


def is_q8_gguf(path: Path) -> bool:
    """Every linear weight of this Llama-family GGUF is Q8_0 (so engine/model_executor/loader.py can serve it natively)."""
    try:
        arch, infos = _infos(path)
    except Exception:  # not a GGUF gguf-py reads: transformers' loader reports it
        return False
    linears = [i for i in infos if i.name.endswith(".weight") and (i.name.split(".")[-2] in LINEAR_PARTS
                                                                      or i.name == "output.weight")]
    return arch in Q8_ARCHS and bool(linears) and all(i.kind == "Q8_0" for i in linears)


def _q8_blocks(raw: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's bytes (34 a block: float16 d, 32 int8 q) as views of them, no copy: (q int8 [N, K / 32, 32],
    d float16 [N, K / 32])."""
    *lead, k = shape  # a mixture of experts' [E, rows, K]: E * rows rows
    n = 1
    for size in lead:
        n *= size
    blocks = raw.view(n, k // 32, 34)
    return blocks[..., 2:].view(torch.int8), blocks[..., :2].view(torch.float16).squeeze(-1)


def _float_tensors(path: Path, infos: list[_Info], arch: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    with open(path, "rb") as f:
        for info in infos:
            name = hf_name(info.name, arch)
            router = name is not None and name.endswith(".mlp.gate.weight")  # 2-D, kept float (F32) by llama.cpp
            if name is None or info.kind == "Q8_0" or (len(info.shape) != 1 and not router):
                continue
            if info.kind not in dtypes:
                raise ValueError(f"GGUF tensor {info.name} is {info.kind}: a 1-D tensor must be F32, F16 or BF16")
            t = read_bytes(f, info).view(dtypes[info.kind]).view(info.shape)
            if arch == "gemma3" and name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + w (transformers too)
                t = t.float() - 1.0
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):  # a bias, permuted as its rows
                heads = hf_config.num_attention_heads if ".q_proj." in name else hf_config.num_key_value_heads
                t = t[unpermute_rows(t.shape[0], heads)]
            yield name, t


@torch.no_grad()
def load_q8_gguf(model: nn.Module, path: Path, hf_config, dtype: torch.dtype) -> int:
    """Load a Q8_0 GGUF (is_q8_gguf) into `model` (a LlamaForCausalLM whose params are allocated, not loaded): the
    norms and biases as floats through model.load_weights, every linear and the token embedding as int8 blocks
    (quant.attach_q8_linear / attach_q8_embedding; an untied Q8_0 one read through a map of the file,
    attach_q8_file_embedding), their float weights released. Returns the int8 linears."""
    arch, infos = _infos(path)
    by_hf = {hf_name(i.name, arch): i for i in infos}
    fused = arch == "phi3"  # q/k/v and gate/up are one tensor each in the file
    layers = model.layers
    # The linears' and the embedding's float weights are never read: release them before the norms load, so
    # load_weights expects no rows for them.
    targets: list[tuple[nn.Module, list[str]]] = []
    for i, layer in enumerate(layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [p + "self_attn.qkv_proj"] if fused else [p + f"self_attn.{x}_proj" for x in "qkv"]
        targets += [(attn.qkv_proj, qkv), (attn.o_proj, [p + "self_attn.o_proj"])]
        if hasattr(mlp, "gate_up_proj"):  # else a mixture of experts: moe.attach_q8_experts below
            gate_up = [p + "mlp.gate_up_proj"] if fused else [p + "mlp.gate_proj", p + "mlp.up_proj"]
            targets += [(mlp.gate_up_proj, gate_up), (mlp.down_proj, [p + "mlp.down_proj"])]
        else:
            mlp.w13 = nn.Parameter(mlp.w13.new_empty(0), requires_grad=False)
            mlp.w2 = nn.Parameter(mlp.w2.new_empty(0), requires_grad=False)
    tied = "lm_head.weight" not in by_hf
    targets.append((model.lm_head, ["model.embed_tokens" if tied else "lm_head"]))
    for module in [m for m, _ in targets] + [model.embed_tokens]:
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    model.load_weights(_float_tensors(path, infos, arch, hf_config))
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    with open(path, "rb") as f:
        def blocks(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            info = by_hf.get(name + ".weight")
            if info is None:
                raise ValueError(f"{path.name} has no tensor for {name}.weight")
            if info.kind == "Q8_0":
                q, d = _q8_blocks(read_bytes(f, info), info.shape)
            else:  # a float tensor (an F16 token embedding, say): quantized here as llama.cpp would
                t = read_bytes(f, info).view({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
                                        [info.kind]).view(info.shape)
                q, d = quantize_q8_0(t)
                q = q.view(q.shape[0], -1, 32)
            part = name.rsplit(".", 1)[-1]
            if arch == "llama" and part in heads:
                order = unpermute_rows(q.shape[0], heads[part])
                q, d = q[order], d[order]
            return q, d

        def pack_module(names: list[str], rows: int, cols: int) -> torch.Tensor:
            """The parts' rows one after another in one packed weight [rows, cols]: a Q8_0 part that needs no
            un-permuting read and packed a chunk of rows at a time (the load holds the packed weights and a few MiB),
            the others whole; parts that do not start on a 16-row block are concatenated first."""
            infos_ = [by_hf.get(n + ".weight") for n in names]
            missing = [n for n, i in zip(names, infos_) if i is None]
            if missing:
                raise ValueError(f"{path.name} has no tensor for {missing[0]}.weight")
            sizes = [i.shape[0] for i in infos_]
            kp = -(-cols // QK) * QK
            if sum(sizes) != rows or any(-(-i.shape[1] // QK) * QK != kp for i in infos_):
                raise ValueError(f"{path.name}: {names} hold [{sum(sizes)}, {infos_[0].shape[1]}] weights, the "
                                 f"model's linear is [{rows}, {cols}]")
            if any(sz % COLS for sz in sizes[:-1]):
                parts = [blocks(n) for n in names]
                return pack_q8(torch.cat([q for q, _ in parts]), torch.cat([d for _, d in parts]))
            out = torch.empty(q8_numel(rows, kp), dtype=torch.uint8)
            row0 = 0
            for name, info in zip(names, infos_):
                streamed = info.kind == "Q8_0" and not (arch == "llama" and name.rsplit(".", 1)[-1] in heads)
                if streamed:
                    row_bytes = kp // QK * 34
                    step = max(COLS, READ_CHUNK_BYTES // row_bytes // COLS * COLS)
                    buf = torch.empty(min(step, info.shape[0]) * row_bytes, dtype=torch.uint8)  # one, reused
                    for r in range(0, info.shape[0], step):
                        r1 = min(info.shape[0], r + step)
                        q, d = _q8_blocks(read_bytes(f, info, r * row_bytes, (r1 - r) * row_bytes, buf), (r1 - r, kp))
                        pack_q8(q, d, out, row0=row0 + r, total_rows=rows)
                else:
                    q, d = blocks(name)
                    pack_q8(q, d, out, row0=row0, total_rows=rows)
                row0 += info.shape[0]
            return out

        for module, names in targets:
            attach_q8_linear(module, pack_module(names, module.out_features, module.in_features))
            _trim_heap()  # each module's transient copies back to the OS: the load's peak stays near the weights
        for i, layer in enumerate(layers):
            if not hasattr(layer.mlp, "gate_up_proj"):
                from engine.model_executor.layers.moe import attach_q8_experts

                p = f"model.layers.{i}.mlp.experts."
                attach_q8_experts(layer.mlp, *(blocks(p + part) for part in ("gate_proj", "up_proj", "down_proj")))
                _trim_heap()
        if tied:
            attach_q8_embedding(model.embed_tokens, model.lm_head._small_weight, dtype)
        elif by_hf.get("model.embed_tokens.weight") is not None and by_hf["model.embed_tokens.weight"].kind == "Q8_0":
            blocks, release = map_rows(path, by_hf["model.embed_tokens.weight"])
            attach_q8_file_embedding(model.embed_tokens, blocks, dtype, release)
        else:  # a float token embedding: quantized into anonymous memory (pack_module)
            emb = model.embed_tokens
            attach_q8_embedding(emb, pack_module(["model.embed_tokens"], emb.num_embeddings, emb.embedding_dim), dtype)
            _trim_heap()
    logger.info("loaded %s's Q8_0 weights as int8 (%d linears, not dequantized)", path.name, len(targets))
    return len(targets)
