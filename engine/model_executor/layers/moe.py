"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): a router picks each token's top-k experts, gated SiLU
MLPs (Qwen2-MoE adds a shared expert every token passes, scaled by a sigmoid gate).

MoEArgs (engine/model_executor/layers/moe_args.py) reads an HF config's expert fields. MoEMLP is one sparse layer's
block:

- the router (`gate`, a linear hidden -> E kept in the model's float dtype: llama.cpp keeps ffn_gate_inp in F32 in
  its quantized files too): softmax in float32, top-k, renormalised over the k chosen (Mixtral always, Qwen3-MoE
  with norm_topk_prob), the weights rounded to the model's dtype as HF's Qwen3-MoE does;
- the experts: w13 [E, 2 * inter, hidden] (each expert's gate rows, then its up rows) and w2 [E, hidden, inter].

On CPU, pack_experts (the loader, after the dense linears are packed or quantized) stacks every expert's weights in
the dense kernels' packed form, float (small_gemm) or Q8_0 (q8_gemm), and releases the float parameters (a GGUF's
experts: attach_gguf_experts, in the file's own blocks, K-quant blobs for kquant_gemm); then
ops.moe_experts (csrc/cpu/moe.cpp) groups the step's tokens by expert and reads each chosen expert once. Elsewhere
(CUDA, the torch backend, before packing) ref_moe runs HF's per-expert loop in torch.

Tensor parallel: the router is whole on every rank; each rank holds 1/N of every expert's intermediate (gate/up
rows, down columns) and the ranks' partial sums are all-reduced, as a dense MLP's.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from engine import ops
from engine.distributed.group import TPGroup
from engine.model_executor.layers.moe_args import MoEArgs
from engine.ops.reference import ref_moe

if TYPE_CHECKING:
    from engine.model_executor.layers.formats import WeightFormat

logger = logging.getLogger(__name__)


class Router(nn.Linear):
    """The router's linear: its own type, so that the dense linears' packers (pack_linears, quantize_linears: plain
    nn.Linear only) leave it to pack_experts, which keeps it in the model's float dtype."""


class MoEMLP(nn.Module):
    """One layer's experts over this rank's share of each expert's intermediate (+ all-reduce)."""

    def __init__(self, hidden: int, m: MoEArgs, dtype: torch.dtype, tp: TPGroup,
                 shared: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.tp, self.args = tp, m
        self.inter = m.intermediate_size // tp.world_size
        self.gate = Router(hidden, m.num_experts, bias=False, dtype=dtype)  # the router, whole on every rank
        self.w13 = nn.Parameter(torch.empty(m.num_experts, 2 * self.inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(m.num_experts, hidden, self.inter, dtype=dtype), requires_grad=False)
        # pack_experts' stacked forms: [E, packed gate | up], [E, packed down] (float, uint8 Q8_0 or int8 blobs of
        # GGML blocks: attach_gguf_experts); None: ref_moe
        self.packed: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        # Qwen2-MoE's shared expert (a dense gated MLP every token passes, all-reduced by itself) and its gate, a
        # linear hidden -> 1 whose sigmoid scales it; float like the router (llama.cpp's ffn_gate_inp_shexp is F32)
        self.shared_expert = shared
        self.shared_expert_gate = Router(hidden, 1, bias=False, dtype=dtype) if shared is not None else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids int64 [T, k], their weights float32 [T, k]), as HF's router computes them."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.args.top_k, dim=-1)
        if self.args.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.args.round_weights:
            weights = weights.to(x.dtype).float()
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        if self.packed is not None and x.device.type == "cpu":  # the compiled decode step makes the same call
            a, x = self.args, x if x.stride(-1) == 1 else x.contiguous()
            out = ops.moe_forward(torch.empty_like(x), x, self.gate(x), *self.packed, self.inter, a.top_k,
                                  a.renormalize, a.round_weights)
        else:
            out = ref_moe(x, *self.route(x), self.w13, self.w2)
        out = self.tp.all_reduce(out)
        if self.shared_expert is not None:  # + sigmoid(x . g) * shared(x), as HF's Qwen2MoeSparseMoeBlock
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


@torch.no_grad()
def pack_experts(model: nn.Module, quantized: bool) -> int:
    """Every CPU MoEMLP of `model` onto ops.moe_experts: the experts stacked in the dense kernels' packed form
    (Q8_0 when `quantized`, float where the small-row kernel serves the dtype), the float parameters released, and
    the router packed as a dense linear. Returns how many layers were packed (0 where the kernels do not serve:
    those keep ref_moe)."""
    from engine.model_executor.layers import cpu_linear, quant

    done = 0
    for layer in moe_layers(model):
        if layer.packed is not None or layer.w13.device.type != "cpu" or layer.w13.numel() == 0:
            continue
        if quantized:
            if not quant.q8_available():
                continue
            layer.packed = (_stack(layer.w13, _q8_packer), _stack(layer.w2, _q8_packer))
        else:
            if not (cpu_linear.small_rows_available() and layer.w13.dtype in cpu_linear.packed_dtypes()):
                continue
            layer.packed = (_stack(layer.w13, _float_packer), _stack(layer.w2, _float_packer))
        layer.w13 = nn.Parameter(layer.w13.new_empty(0), requires_grad=False)
        layer.w2 = nn.Parameter(layer.w2.new_empty(0), requires_grad=False)
        if cpu_linear.packed_linear_available() and layer.gate.weight.dtype in cpu_linear.packed_dtypes():
            cpu_linear._pack(layer.gate)
            layer.gate.weight = nn.Parameter(layer.gate.weight.new_empty(0), requires_grad=False)
        cpu_linear._trim_heap()
        done += 1
    if done:
        logger.info("packed the experts of %d MoE layers (%s)", done, "Q8_0" if quantized else "float")
    return done


def _float_packer(w: torch.Tensor):  # one expert's [n, k] -> (numel, pack into a 1-D slot)
    from engine.model_executor.layers.cpu_linear import pack_small_rows, small_rows_numel

    return small_rows_numel(w), w.dtype, lambda out: pack_small_rows(w, out)


def _q8_packer(w: torch.Tensor):
    from engine.model_executor.layers.quant import pack_q8, q8_numel, quantize_q8_0

    return q8_numel(*w.shape), torch.uint8, lambda out: pack_q8(*quantize_q8_0(w), out=out)


def _stack(w: torch.Tensor, packer) -> torch.Tensor:
    """[E, n, k] -> [E, packed numel]: each expert packed into its row of one huge-paged buffer (row starts
    64-byte aligned where the element count allows: the kernels stream each expert from its start)."""
    from engine.model_executor.layers.cpu_linear import huge_page_buffer

    numel, dtype, _ = packer(w[0])
    size = torch.empty((), dtype=dtype).element_size()
    buf = huge_page_buffer(w.shape[0] * numel * size).view(dtype).view(w.shape[0], numel)
    for e in range(w.shape[0]):
        packer(w[e])[2](buf[e])
    return buf


@torch.no_grad()
def attach_gguf_experts(layer: MoEMLP, gate: tuple[WeightFormat, torch.Tensor],
                        up: tuple[WeightFormat, torch.Tensor], down: tuple[WeightFormat, torch.Tensor]) -> None:
    """A GGUF's experts (llama.cpp's ffn_gate_exps / ffn_up_exps / ffn_down_exps: each (format, raw uint8
    [E * rows, row_bytes]), expert-major) packed in their own blocks, never dequantized, into the layer's stacked
    form: gate | up, and down, each as the dense linears' attach_quantized_linear holds a linear's parts: all Q8_0
    as q8_gemm's uint8 form (pack_q8), else one formats.pack_parts int8 blob an expert (a Q4_K_M file: Q4_K gate |
    up, Q6_K or Q4_K down) for kquant_gemm. The router packed as pack_experts does
    (engine/model_executor/gguf_native.py)."""
    from engine.model_executor.layers import cpu_linear

    e, inter, hidden = layer.args.num_experts, layer.inter, layer.gate.in_features
    if gate[1].shape[0] != e * inter or up[1].shape[0] != e * inter or down[1].shape[0] != e * hidden:
        raise ValueError(f"GGUF experts of {gate[1].shape[0]} gate, {up[1].shape[0]} up and {down[1].shape[0]} "
                         f"down rows, the model's {e} experts need {e * inter}, {e * inter} and {e * hidden}")
    layer.packed = (_stack_parts([gate, up], e, inter), _stack_parts([down], e, hidden))
    layer.w13 = nn.Parameter(layer.w13.new_empty(0), requires_grad=False)
    layer.w2 = nn.Parameter(layer.w2.new_empty(0), requires_grad=False)
    if cpu_linear.packed_linear_available() and layer.gate.weight.dtype in cpu_linear.packed_dtypes():
        cpu_linear._pack(layer.gate)
        layer.gate.weight = nn.Parameter(layer.gate.weight.new_empty(0), requires_grad=False)


def _stack_parts(parts: list[tuple[WeightFormat, torch.Tensor]], experts: int, rows: int) -> torch.Tensor:
    """Each expert's rows of `parts` (expert-major raw rows) packed into its row of one huge-paged buffer: uint8
    [E, q8_numel] when every part is Q8_0, else int8 [E, blob bytes] (one tensor's experts share a type: equal
    blobs, 64-byte multiples, so each expert's starts aligned)."""
    from engine.model_executor.layers.cpu_linear import huge_page_buffer
    from engine.model_executor.layers.formats import pack_parts, pack_q8_parts
    from engine.model_executor.layers.quant import q8_numel

    k = parts[0][1].shape[1] // parts[0][0].block_bytes * parts[0][0].block_weights
    if all(fmt.name == "Q8_0" for fmt, _ in parts):
        buf = huge_page_buffer(experts * q8_numel(rows * len(parts), k)).view(experts, -1)
        for i in range(experts):
            pack_q8_parts([(fmt, raw[i * rows:(i + 1) * rows]) for fmt, raw in parts], out=buf[i])
        return buf
    buf = None
    for i in range(experts):
        blob = pack_parts([(fmt, raw[i * rows:(i + 1) * rows]) for fmt, raw in parts])
        if buf is None:
            buf = huge_page_buffer(experts * blob.numel()).view(torch.int8).view(experts, -1)
        buf[i] = blob
    return buf
