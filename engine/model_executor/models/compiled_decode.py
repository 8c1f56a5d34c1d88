"""A CPU step's decoder layers in one compiled call (csrc/cpu/decode_layers.cpp) instead of op-by-op Python.

The eager layers (engine/model_executor/models/llama.py) call ~12 ops per layer through Python; at one sequence that costs
~150 us a layer (docs/benchmarks.md, "Compiled decode step"). llama_decode_layers runs the eager layers'
arithmetic in their order on the same buffers from C++ (the MLP's gate/up linear and its activation as one kernel,
small_gemm_glu, on the AVX-512 paths: the same bits), so its result is bit-identical to the eager forward's: only
the Python between the kernels is gone. It was built for decode steps, where those calls were ~25 % of the step;
it runs prefill and mixed prefill + decode steps too (their prompts with or without a cached prefix), which saves
the same few milliseconds of a first token. The eager path stays the reference: `--enforce-eager`
(EngineConfig.enforce_eager) switches this one off, and every step it does not cover runs eagerly:

- CUDA (the ops' CUDA kernels; the CUDA graphs of engine/worker/cuda_graphs.py are that device's twin of this), the torch-reference backend;
- tensor parallelism (the all-reduces are Python collectives);
- linears not served by the small-row kernel at this row count (oneDNN's rows, PAGEDSERVE_SMALL_ROW_LINEAR=0,
  a model whose linears were not packed): on a CPU where oneDNN keeps the prefill (bfloat16 with AMX) only
  steps of up to 16 tokens.

Nothing is traced or generated at run time: the loop is part of the ops' JIT build (engine/ops/build.py, cached
under $PAGEDSERVE_CACHE, with its progress line at the first build).

The plan holds the tensors the loop reads (weights and the rotary table's owner), never the model: the model keeps
its plan (LlamaForCausalLM.compiled_plan). Use (LlamaForCausalLM.forward, each step):

    plan = CompiledDecode.build(layers, args)  # None: these layers cannot run compiled
    if plan is not None and plan.serves(x, kv_caches, meta):
        hidden = plan(x, positions, kv_caches, meta)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from engine import ops
from engine.model_executor.layers.attention import AttentionMetadata, KVCache
from engine.model_executor.layers.cpu_linear import small_rows_weight
from engine.model_executor.layers.moe import MoEMLP
from engine.model_executor.models.llama_args import MLP_ACTS, ModelArgs

_NO_BIAS = torch.empty(0)  # an absent bias or norm
_NO_TABLE = torch.empty(0, dtype=torch.int32)  # a prefill span without a cached prefix; no decode context lengths
_NO_TABLES = torch.empty(0, 1, dtype=torch.int32)  # no decode tokens


class CompiledDecode:
    """The tensors llama_decode_layers reads, gathered once from a packed model's layers, and the test for a step."""

    def __init__(self, layers: Sequence[nn.Module], args: ModelArgs, weights: list[torch.Tensor],
                 max_rows: int) -> None:
        attn = layers[0].self_attn
        self.rotaries = [layer.self_attn.rotary for layer in layers]  # the cos/sin tables' owners (built on first use)
        self.weights = weights
        self.max_rows = max_rows  # the fewest rows any linear's small-row kernel serves
        self.windows = [0 if w is None else int(w) for w in args.layer_windows]
        dense = [layer.mlp.inter for layer in layers if not isinstance(layer.mlp, MoEMLP)]
        self.shape = (attn.heads, attn.kv_heads, attn.head_dim, dense[0] if dense else 1)  # a dense MLP's width
        self.eps, self.scale = float(args.rms_norm_eps), float(attn.attn.scale)
        self.mlp_act = MLP_ACTS.index(args.mlp_act)
        self.softcap = args.attn_softcap
        self.steps_run = 0  # forwards this plan ran (tests check that the fast path was taken)

    @classmethod
    def build(cls, layers: Sequence[nn.Module], args: ModelArgs) -> Optional["CompiledDecode"]:
        """The plan of the decoder's layers (LlamaBlock, any family of the spec), or None while they cannot run
        compiled: a linear not on the small-row kernel (not packed yet, or oneDNN only), tensor parallelism, or not
        the compiled CPU backend."""
        if layers[0].self_attn.tp.world_size != 1 or ops.backend() is not ops.OpsBackend.COMPILED_CPU:
            return None
        weights, max_rows = [], None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            moe = isinstance(mlp, MoEMLP)
            mlp_linears = (mlp.gate,) if moe else (mlp.gate_up_proj, mlp.down_proj)
            small = [small_rows_weight(linear) for linear in (attn.qkv_proj, attn.o_proj, *mlp_linears)]
            shared = mlp.shared_expert if moe else None  # Qwen2-MoE's
            shared_small = [small_rows_weight(lin) for lin in (shared.gate_up_proj, shared.down_proj)] if shared else []
            small += shared_small
            if any(s is None for s in small) or (moe and mlp.packed is None):
                return None  # not packed, or oneDNN only: the eager path
            rows = min(r for _, r in small)
            max_rows = rows if max_rows is None else min(max_rows, rows)
            (qkv, _), (o, _) = small[:2]
            # csrc/cpu/decode_layers.cpp's Slot order; a mixture-of-experts layer's MLP slots hold its router,
            # settings and experts (_moe_slots)
            mlp_slots = _moe_slots(mlp, small[2][0]) if moe else [
                small[2][0], _bias(mlp.gate_up_proj), small[3][0], _bias(mlp.down_proj)]
            weights += [
                layer.input_layernorm.weight, qkv, _bias(attn.qkv_proj), _norm(attn.q_norm), _norm(attn.k_norm),
                o, _bias(attn.o_proj), _norm(layer.attn_out_norm), layer.pre_mlp_norm.weight,
                *mlp_slots, _norm(layer.mlp_out_norm),
                *((shared_small[0][0], shared_small[1][0], mlp.shared_expert_gate.weight) if shared else
                  (_NO_BIAS, _NO_BIAS, _NO_BIAS)),
            ]
        if max_rows is None or len(weights) != len(layers) * ops.decode_layer_slots():
            return None
        return cls(layers, args, [w.detach() for w in weights], max_rows)

    def serves(self, x: torch.Tensor, kv_caches: Optional[list[KVCache]], meta: AttentionMetadata) -> bool:
        """Whether this step is one the compiled loop runs: on a real CPU cache, every linear on the small-row
        kernel at this row count, the prefill spans laid out from row 0 and the decode tokens after them."""
        rows = x.shape[0]
        if not (
            kv_caches is not None
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
            x, positions, [r.table(x.device) for r in self.rotaries], self.weights, [c[0] for c in kv_caches],
            [c[1] for c in kv_caches], meta.slot_mapping, spans, tables,
            meta.decode_block_tables if decoding else _NO_TABLES, meta.decode_context_lens if decoding else _NO_TABLE,
            self.windows, heads, kv_heads, head_dim, inter, self.eps, self.scale, self.mlp_act,
            self.softcap,
        )


def _moe_slots(mlp: MoEMLP, router: torch.Tensor) -> list[torch.Tensor]:
    """A mixture-of-experts layer's four MLP slots (csrc/cpu/decode_layers.cpp moe_mlp): the router's packed weight,
    its settings as an int64 tensor (whose dtype marks the layer), the stacked experts' gate | up and down."""
    a = mlp.args
    shared = mlp.shared_expert.inter if mlp.shared_expert is not None else 0
    settings = torch.tensor([mlp.inter, a.top_k, a.renormalize, a.round_weights, a.num_experts, shared],
                            dtype=torch.int64)
    return [router, settings, *mlp.packed]


def _bias(linear: nn.Linear) -> torch.Tensor:
    return _NO_BIAS if linear.bias is None else linear.bias


def _norm(norm: Optional[nn.Module]) -> torch.Tensor:
    return _NO_BIAS if norm is None else norm.weight
