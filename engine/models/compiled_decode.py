"""A CPU step's decoder layers in one compiled call (csrc/cpu/decode_layers.cpp) instead of op-by-op Python.

The eager layers (engine/models/llama.py) call ~12 ops per layer through Python; at one sequence that costs
~150 us a layer (docs/benchmarks.md, "Compiled decode step"). llama_decode_layers runs the eager layers'
arithmetic in their order on the same buffers from C++ (the MLP's gate/up linear and its activation as one kernel,
small_gemm_glu, on the AVX-512 paths: the same bits), so its result is bit-identical to the eager forward's: only
the Python between the kernels is gone. It was built for decode steps, where those calls were ~25 % of the step; it runs
prefill and mixed prefill + decode steps too (their prompts with or without a cached prefix), which saves the
same few milliseconds of a first token. The eager path stays the reference: `--enforce-eager`
(EngineConfig.enforce_eager) switches this one off, and every step it does not cover runs eagerly:

- CUDA (the ops' CUDA kernels; CUDA graphs would be that device's twin of this), the torch-reference backend;
- tensor parallelism (the all-reduces are Python collectives);
- linears not served by the small-row kernel at this row count (oneDNN's rows, PAGEDSERVE_SMALL_ROW_LINEAR=0,
  a model whose linears were not packed): on a CPU where oneDNN keeps the prefill (bfloat16 with AMX) only
  steps of up to 16 tokens.

Nothing is traced or generated at run time: the loop is part of the ops' JIT build (engine/ops_loader.py, cached
under $PAGEDSERVE_CACHE, with its progress line at the first build).

Use (LlamaForCausalLM.forward, each step):

    plan = CompiledDecode.of(model)          # None: this model can never use it (built once, then cached)
    if plan is not None and plan.serves(x, kv_caches, meta):
        hidden = plan(x, positions, kv_caches, meta)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from engine import ops
from engine.attention import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

_NO_BIAS = torch.empty(0)
_NO_TABLE = torch.empty(0, dtype=torch.int32)  # a prefill span without a cached prefix; no decode context lengths
_NO_TABLES = torch.empty(0, 1, dtype=torch.int32)  # no decode tokens


class CompiledDecode:
    """The tensors llama_decode_layers reads, gathered once from a packed model, and the test for a step."""

    def __init__(self, model: "LlamaForCausalLM", weights: list[torch.Tensor], max_rows: int) -> None:
        a = model.args
        attn = model.layers[0].self_attn
        self.model = model
        self.weights = weights
        self.max_rows = max_rows  # the fewest rows any linear's small-row kernel serves
        self.windows = [0 if w is None else int(w) for w in a.layer_windows]
        self.shape = (attn.heads, attn.kv_heads, attn.head_dim, model.layers[0].mlp.inter)
        self.eps, self.scale = float(a.rms_norm_eps), float(attn.attn.scale)
        self.steps_run = 0  # forwards this plan ran (tests check that the fast path was taken)

    @classmethod
    def of(cls, model: "LlamaForCausalLM") -> Optional["CompiledDecode"]:
        """The model's plan, built on first use and kept on it; None when this model can never use one (cached too)."""
        cached = model.__dict__.get("_compiled_decode", False)
        if cached is False:
            cached = model.__dict__["_compiled_decode"] = cls._build(model)
        return cached

    @classmethod
    def _build(cls, model: "LlamaForCausalLM") -> Optional["CompiledDecode"]:
        if model.tp.world_size != 1 or ops.backend() is not ops.OpsBackend.COMPILED_CPU:
            return None
        weights, max_rows = [], None
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if getattr(linear, "_small_weight", None) is None:
                    return None  # not packed, or oneDNN only: the eager path
                max_rows = linear._small_max_rows if max_rows is None else min(max_rows, linear._small_max_rows)
            weights += [
                layer.input_layernorm.weight, attn.qkv_proj._small_weight, _bias(attn.qkv_proj),
                attn.o_proj._small_weight, _bias(attn.o_proj), layer.post_attention_layernorm.weight,
                mlp.gate_up_proj._small_weight, _bias(mlp.gate_up_proj), mlp.down_proj._small_weight,
                _bias(mlp.down_proj),
            ]
        if max_rows is None or len(weights) != len(model.layers) * ops.decode_layer_slots():
            return None
        return cls(model, [w.detach() for w in weights], max_rows)

    def serves(self, x: torch.Tensor, kv_caches: Optional[list[KVCache]], meta: AttentionMetadata) -> bool:
        """Whether this step is one the compiled loop runs: on a real CPU cache, every linear on the small-row
        kernel at this row count, the prefill spans laid out from row 0 and the decode tokens after them."""
        rows = x.shape[0]
        if not (
            self.model.compiled_decode
            and kv_caches is not None
            and 0 < rows <= self.max_rows
            and rows == meta.num_prefill_tokens + meta.num_decode_tokens
            and x.device.type == "cpu"
            and kv_caches[0][0].numel() > 0
            and meta.prefill_batch is None
        ):
            return False
        row = 0
        for span in meta.prefills:
            if span.start != row or (span.num_cached and span.block_table is None):
                return False
            row = span.end
        return row == meta.num_prefill_tokens

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden] before the final norm, as forward returns
        heads, kv_heads, head_dim, inter = self.shape
        self.steps_run += 1
        spans = [n for p in meta.prefills for n in (p.start, p.end, p.context_len)]
        tables = [p.block_table if p.num_cached else _NO_TABLE for p in meta.prefills]
        decoding = meta.num_decode_tokens > 0
        # Split per step (~60 list items: microseconds), not cached on the plan: a cached split would keep an engine
        # reset's old KV cache alive after LLMEngine.reset dropped it, next to the new one.
        return ops.llama_decode_layers(
            x, positions, self.model.rotary.table(x.device), self.weights, [c[0] for c in kv_caches],
            [c[1] for c in kv_caches], meta.slot_mapping, spans, tables,
            meta.decode_block_tables if decoding else _NO_TABLES, meta.decode_context_lens if decoding else _NO_TABLE,
            self.windows, heads, kv_heads, head_dim, inter, self.eps, self.scale,
        )


def _bias(linear: nn.Linear) -> torch.Tensor:
    return _NO_BIAS if linear.bias is None else linear.bias
