"""Checkpoint tensors into a LlamaForCausalLM: HF names onto the fused q/k/v and gate/up params, and under tensor
parallelism each rank's shard of them (Megatron-style, see LlamaForCausalLM). The model is passed with its args and
its rank's group (this module reads nothing else of it, and does not import it)."""
from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn

from engine.distributed.group import TPGroup
from engine.model_executor.models.llama_args import ModelArgs


def _fused_targets(a: ModelArgs, tp: TPGroup, name: str) -> Optional[tuple[str, int, int]]:
    """HF name -> (our fused param, row offset, rows) for q/k/v and gate/up, this rank's sizes; None for a
    plain name."""
    n = tp.world_size
    q, kv, inter = a.num_heads * a.head_dim // n, a.local_kv_heads(n) * a.head_dim, a.intermediate_size // n
    shards = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
    }
    if a.moe is not None and a.moe.shared_intermediate_size:  # Qwen2-MoE's shared expert, a gated MLP of its own
        shared = a.moe.shared_intermediate_size // n
        shards["shared_expert.gate_proj"] = ("shared_expert.gate_up_proj", 0, shared)
        shards["shared_expert.up_proj"] = ("shared_expert.gate_up_proj", shared, shared)
    for hf_part, (ours, offset, rows) in shards.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, ours), offset, rows
    return None

# Prefixes of a multimodal checkpoint's text model (Gemma3ForConditionalGeneration: transformers 4's names, then 5's);
# its other towers have no place in a text decoder.
_TEXT_PREFIXES = (("language_model.model.", ""), ("model.language_model.", ""), ("language_model.lm_head.", "lm_head."))
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _checkpoint_name(hf_name: str) -> Optional[str]:
    """Our name of a checkpoint tensor before fusing (layers.N.self_attn.q_proj.weight, ...), None to skip it."""
    if "rotary_emb.inv_freq" in hf_name or hf_name.startswith(_OTHER_TOWERS):
        return None
    for prefix, ours in _TEXT_PREFIXES:
        if hf_name.startswith(prefix):
            return ours + hf_name[len(prefix):]
    return hf_name.removeprefix("model.")


def _unfused(a: ModelArgs, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's fused projections (Phi-3's qkv_proj and gate_up_proj) as the q/k/v and gate/up parts they
    hold, so that one path fuses and shards every family's (the parts' rows in HF's order: q | k | v, gate | up)."""
    q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    for fused, parts in ((".self_attn.qkv_proj.", (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
                         (".mlp.gate_up_proj.", (("gate_proj", inter), ("up_proj", inter)))):
        if fused in f".{name}" and tensor.shape[0] == sum(rows for _, rows in parts):
            start = 0
            for part, rows in parts:
                yield name.replace(fused.strip(".").split(".")[1], part), tensor[start:start + rows]
                start += rows
            return
    yield name, tensor


def _shard(tp: TPGroup, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole checkpoint tensor (our param name; the tensor itself at world_size 1).

    Column-parallel (q/k/v, gate/up, the vocab of embedding and head): rows split. Row-parallel (o_proj,
    down_proj): columns split, and the bias kept by rank 0 alone, so the all-reduce adds it once."""
    if tp.world_size == 1:
        return tensor
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        return tensor if tp.is_driver else torch.zeros_like(tensor)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        start, end = tp.shard(tensor.shape[1])
        return tensor[:, start:end]
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight", "gate_up_proj.bias")) \
            or name in ("embed_tokens.weight", "lm_head.weight"):
        start, end = tp.shard(tensor.shape[0])
        return tensor[start:end]
    return tensor  # norms: whole on every rank

def _kv_replica(a: ModelArgs, tp: TPGroup, name: str) -> Optional[slice]:
    """The rows of the one key/value head this rank holds, for k_proj / v_proj when the ranks outnumber the
    key/value heads (rank r holds head r * kv_heads // N, the head its query heads read); None otherwise."""
    if a.num_kv_heads >= tp.world_size or not (".self_attn.k_proj." in name or ".self_attn.v_proj." in name):
        return None
    head = tp.rank * a.num_kv_heads // tp.world_size
    return slice(head * a.head_dim, (head + 1) * a.head_dim)

# An expert's linear in HF's names (Qwen3-MoE's experts.N.gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2), after
# Mixtral's block_sparse_moe is renamed mlp.
_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def _expert_target(a: ModelArgs, tp: TPGroup, name: str, tensor: torch.Tensor
                   ) -> Optional[tuple[str, int, int, torch.Tensor]]:
    """An expert's HF tensor -> (our stacked param, expert, row offset, this rank's part): gate and up are rows of
    w13 [E, 2 * inter, hidden] (each rank's 1/N of the intermediate), down is w2 [E, hidden, inter] (its columns
    split); None for any other name."""
    match = _EXPERT.match(name) if a.moe is not None else None
    if match is None:
        return None
    layer, expert, part = match.group(1), int(match.group(2)), _EXPERT_PART[match.group(3)]
    inter = a.moe.intermediate_size // tp.world_size
    start, end = tp.shard(a.moe.intermediate_size)
    if part == 2:
        return f"{layer}.w2", expert, 0, tensor[:, start:end]
    return f"{layer}.w13", expert, part * inter, tensor[start:end]


@torch.no_grad()
def load_weights(model: nn.Module, args: ModelArgs, tp: TPGroup, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> None:
    """Copy HF state-dict tensors (model.layers.N.self_attn.q_proj.weight, ...) into our fused params."""
    params = dict(model.named_parameters())
    rows_loaded = dict.fromkeys(params, 0)
    for hf_name, tensor in _named(args, weights):
        name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's experts and router
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue  # tied: the embedding is the head
        expert = _expert_target(args, tp, name, tensor)
        if expert is not None:
            target, e, offset, part = expert
            params[target][e, offset : offset + part.shape[0]].copy_(part)
            rows_loaded[target] += part.shape[0]
            continue
        replica = _kv_replica(args, tp, name)
        fused = _fused_targets(args, tp, name)
        name, offset = fused[:2] if fused is not None else (name, 0)
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}.")
        tensor = tensor[replica] if replica is not None else _shard(tp, name, tensor)
        rows = tensor.shape[0]
        params[name][offset : offset + rows].copy_(tensor)
        rows_loaded[name] += rows
    expected = {n: p.shape[0] * p.shape[1] if p.dim() == 3 else p.shape[0] for n, p in params.items()}  # experts: rows
    missing = [n for n in params if rows_loaded[n] != expected[n]]
    if missing:
        raise ValueError(f"checkpoint is missing or duplicates tensors for {len(missing)} params, e.g. {missing[:3]}.")

def _named(args: ModelArgs, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under our names before fusing, fused ones split, norms as the one kernel scales:
    x * (norm_offset + w) (Gemma's x * (1 + w)) is the weight plus the offset, added in float32 as HF does."""
    for hf_name, tensor in weights:
        name = _checkpoint_name(hf_name)
        if name is None:
            continue
        if args.norm_offset and name.endswith("norm.weight"):
            tensor = tensor.float() + args.norm_offset
        yield from _unfused(args, name, tensor)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, args: ModelArgs, tp: TPGroup, seed: int = 0) -> None:
    """Random weights (benchmarks of big architectures with nothing to download); norms start at one.
    The whole model's tensors are drawn and then sharded, so every tensor-parallel size runs the same model."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def tensors() -> Iterable[tuple[str, torch.Tensor]]:
        for name, shape in _checkpoint_shapes(args):
            if name.endswith("norm.weight"):
                yield name, torch.full(shape, 1.0 - args.norm_offset)  # the norms' scale starts at one
            else:
                yield name, torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02)

    load_weights(model, args, tp, tensors())

def _checkpoint_shapes(a: ModelArgs) -> Iterable[tuple[str, tuple[int, ...]]]:
    """(HF name, whole shape) of every checkpoint tensor of this architecture."""
    h, q, kv, inter = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    yield "embed_tokens.weight", (a.vocab_size, h)
    for i in range(a.num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        yield f"layers.{i}.input_layernorm.weight", (h,)
        yield f"layers.{i}.post_attention_layernorm.weight", (h,)
        if a.sandwich_norms:
            yield f"layers.{i}.pre_feedforward_layernorm.weight", (h,)
            yield f"layers.{i}.post_feedforward_layernorm.weight", (h,)
        if a.qk_norm:
            yield f"{attn}q_norm.weight", (a.head_dim,)
            yield f"{attn}k_norm.weight", (a.head_dim,)
        for part, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield f"{attn}{part}.weight", (rows, h)
            if a.qkv_bias:
                yield f"{attn}{part}.bias", (rows,)
        yield f"{attn}o_proj.weight", (h, q)
        if a.o_bias:
            yield f"{attn}o_proj.bias", (h,)
        if a.moe is not None and a.moe.sparse_layers[i]:
            yield f"{mlp}gate.weight", (a.moe.num_experts, h)
            for e in range(a.moe.num_experts):
                m = a.moe.intermediate_size
                for part, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
                    yield f"{mlp}experts.{e}.{part}.weight", shape
            if a.moe.shared_intermediate_size:
                s = a.moe.shared_intermediate_size
                for part, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
                    yield f"{mlp}shared_expert.{part}.weight", shape
                yield f"{mlp}shared_expert_gate.weight", (1, h)
            continue
        for part, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            yield f"{mlp}{part}.weight", shape
            if a.mlp_bias:
                yield f"{mlp}{part}.bias", shape[:1]
    yield "norm.weight", (h,)
    if not a.tie_word_embeddings:
        yield "lm_head.weight", (a.vocab_size, h)
