"""The one decoder of every family pagedserve serves (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3; SmolLM2 is a Llama) on a
flattened, unpadded batch and the paged KV cache, driven by the per-architecture spec (llama_args.ModelArgs): a family
is its spec plus its weight-name map (llama_weights.py), never a copy of this file."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from engine import ops

from engine.model_executor.layers import cpu_linear
from engine.model_executor.layers.attention import Attention, AttentionMetadata, KVCache
from engine.model_executor.layers.moe import MoEMLP
from engine.distributed.group import TPGroup
from engine.model_executor.models.compiled_decode import CompiledDecode
from engine.model_executor.models.llama_args import MLP_ACTS, ModelArgs
from engine.model_executor.models.rope import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_inv_freq  # noqa: F401
import engine.model_executor.models.llama_weights as llama_weights

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, dim]
        # HF numerics: normalise in float32, cast back, then scale.
        return ops.rms_norm(torch.empty_like(x), x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in place in one pass: x and residual are consumed."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads: qkv_proj column-parallel, o_proj row-parallel (+ all-reduce)."""

    def __init__(self, a: ModelArgs, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: Optional[int], tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.eps = tp, a.rms_norm_eps
        self.heads, self.kv_heads = a.num_heads // tp.world_size, a.local_kv_heads(tp.world_size)
        self.head_dim = a.head_dim
        self.q_size, self.kv_size = self.heads * a.head_dim, self.kv_heads * a.head_dim
        # q, k and v in one matmul: fewer, larger GEMMs are faster on CPU and GPU alike.
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.o_bias, dtype=dtype)
        # Qwen3, Gemma 3: per-head RMSNorm of q and k before RoPE (weights [head_dim], whole on every rank)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype) if a.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.heads, self.kv_heads, a.head_dim, scale=a.attn_scale,
                              sliding_window=sliding_window, softcap=a.attn_softcap)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: Optional[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:  # x: [num_tokens, hidden]; positions: [num_tokens]
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.heads + self.kv_heads, self.head_dim)
        # Strided views, no copies: the cache and attention ops only need each head's vector contiguous.
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        if self.q_norm is not None:
            ops.rms_norm_heads(q, self.q_norm.weight, self.eps)
            ops.rms_norm_heads(k, self.k_norm.weight, self.eps)
        self.rotary(positions, qk)  # q and k rotated together, in place
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)  # [num_tokens, heads, head_dim]
        return self.tp.all_reduce(self.o_proj(out.view(t, self.q_size)))  # each rank's heads' share, summed


class LlamaMLP(nn.Module):
    """A gated MLP (SwiGLU; Gemma's GELU-tanh) over this rank's columns: gate_up_proj column-parallel, down_proj
    row-parallel (+ all-reduce)."""

    def __init__(self, a: ModelArgs, dtype: torch.dtype, tp: TPGroup, intermediate_size: Optional[int] = None
                 ) -> None:
        super().__init__()
        self.tp = tp
        self.act = ops.gelu_tanh_and_mul if a.mlp_act == "gelu_tanh" else ops.silu_and_mul
        self.act_index = MLP_ACTS.index(a.mlp_act)  # the compiled step's encoding
        self.inter = (intermediate_size or a.intermediate_size) // tp.world_size  # a shared expert's own width
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * self.inter, bias=a.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(self.inter, a.hidden_size, bias=a.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * inter]: gate | up
        act = self.act(gate_up.new_empty(x.shape[0], self.inter), gate_up)
        return self.tp.all_reduce(self.down_proj(act))


class LlamaBlock(nn.Module):
    def __init__(self, a: ModelArgs, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: Optional[int], tp: TPGroup, sparse: bool = False) -> None:
        super().__init__()
        norm = lambda: RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(a, rotary, dtype, sliding_window, tp)
        self.post_attention_layernorm = norm()
        # a mixture-of-experts model's sparse layers: the router and its experts (engine/model_executor/layers/moe.py)
        if sparse:
            shared = a.moe.shared_intermediate_size
            self.mlp = MoEMLP(a.hidden_size, a.moe, dtype, tp,
                              LlamaMLP(a, dtype, tp, shared) if shared else None)
        else:
            self.mlp = LlamaMLP(a, dtype, tp)
        # Gemma (sandwich_norms): post_attention_layernorm norms the attention output, pre/post_feedforward_layernorm
        # the MLP's input and output. The roles below name them (Llama's post_attention_layernorm is its pre-MLP norm).
        self.sandwich = a.sandwich_norms
        if a.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    @property
    def attn_out_norm(self) -> Optional[RMSNorm]:  # the attention output's norm before its residual add (Gemma)
        return self.post_attention_layernorm if self.sandwich else None

    @property
    def pre_mlp_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    @property
    def mlp_out_norm(self) -> Optional[RMSNorm]:  # the MLP output's norm before its residual add (Gemma)
        return self.post_feedforward_layernorm if self.sandwich else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous block's MLP output (the embeddings for block 0)
        residual: Optional[torch.Tensor],  # [num_tokens, hidden]: the stream before x is added; None for block 0
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: Optional[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this block's MLP output, the stream before it is added)
        # The residual adds ride in the norms (one pass each, in place): the stream is residual + x throughout.
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        if self.attn_out_norm is not None:
            x = self.attn_out_norm(x)
        x, residual = self.pre_mlp_norm.add_and_norm(x, residual)
        x = self.mlp(x)
        return (x if self.mlp_out_norm is None else self.mlp_out_norm(x)), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder whose forward runs one flattened batch of tokens from many sequences.

    Under tensor parallelism (tp.world_size N > 1) this is one rank's shard: 1/N of the heads, key/value heads
    and MLP columns, and 1/N of the vocabulary in the embedding and the head; the norms are whole on every rank.
    """

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32, max_len: Optional[int] = None,
                 tp: Optional[TPGroup] = None, serve_len: Optional[int] = None) -> None:
        super().__init__()
        a = self.args = ModelArgs.from_hf(hf_config)
        self.tp = tp = tp or TPGroup.single()
        a.check_tensor_parallel(tp.world_size)
        self.vocab_start, self.vocab_end = tp.shard(a.vocab_size)
        self.dtype = dtype
        max_len = max_len or getattr(hf_config, "max_position_embeddings", 2048)
        # One RoPE per kind of layer (Gemma 3's sliding and global layers each have theirs), shared by its layers.
        self.rotaries = {key: RotaryEmbedding(*rope_inv_freq(hf_config, a.head_dim, max_len, key, serve_len),
                                              max_len) for key in dict.fromkeys(a.layer_rope)}
        self.rotary = self.rotaries[a.layer_rope[0]]
        local_vocab = self.vocab_end - self.vocab_start
        # _weight: no random init (on the meta device torch's normal_ imports torch._dynamo and triton: +100 MiB RSS).
        self.embed_tokens = nn.Embedding(local_vocab, a.hidden_size, dtype=dtype,
                                         _weight=torch.empty(local_vocab, a.hidden_size, dtype=dtype))
        sparse = a.moe.sparse_layers if a.moe is not None else (False,) * a.num_layers
        self.layers = nn.ModuleList(LlamaBlock(a, self.rotaries[r], dtype, w, tp, s)
                                    for w, r, s in zip(a.layer_windows, a.layer_rope, sparse))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(a.hidden_size, local_vocab, bias=False, dtype=dtype)
        self.tie_weights()
        # CPU steps through the compiled layer loop where it serves (engine/model_executor/models/compiled_decode.py);
        # False: every step eagerly (--enforce-eager, the reference).
        self.compiled_decode = True
        self._compiled_plan: Optional[CompiledDecode] = None

    @property
    def kv_window(self) -> Optional[int]:
        """The window every layer attends within, if they all have one: cache blocks wholly before it are
        never read again and may be released. None when any layer reads the whole context."""
        windows = set(self.args.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    def tie_weights(self) -> None:
        """Share the embedding with the head (SmolLM2); call again after to_empty(), which unties them."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: Optional[list[KVCache]],  # one per layer; None to run without a cache (profiling)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] before the final norm; compute_logits finishes the rows asked for
        x, residual = self.embed(input_ids), None
        plan = self.compiled_plan() if self.compiled_decode else None
        if plan is not None and plan.serves(x, kv_caches, meta):
            return plan(x, positions, kv_caches, meta)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, kv_caches[i] if kv_caches is not None else None, meta)
        return x if residual is None else residual.add_(x)

    def compiled_plan(self) -> Optional[CompiledDecode]:
        """The compiled step's plan (engine/model_executor/models/compiled_decode.py), built at the first call after the layers'
        linears went onto the small-row kernel and kept; None before that and where it never serves (CUDA, tensor
        parallelism, oneDNN-only linears). The packers (cpu_linear.pack_linears, engine/model_executor/layers/quant.py) run once, before
        the first forward (engine/model_executor/loader.py), so a kept plan never reads weights they replaced."""
        if self._compiled_plan is None:
            self._compiled_plan = CompiledDecode.build(self.layers, self.args)
        return self._compiled_plan

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        x = self._embed(input_ids)
        if self.args.embed_scale is not None:  # Gemma: HF multiplies by sqrt(hidden) rounded to the dtype
            x.mul_(torch.tensor(self.args.embed_scale, dtype=x.dtype))
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: each rank looks up the ids in its slice, zeros the others' rows; the sum has them all.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [num_tokens]
        local_ids = (input_ids - self.vocab_start).clamp_(0, self.vocab_end - self.vocab_start - 1)
        x = self.embed_tokens(local_ids)
        x.mul_(mine.unsqueeze(1).to(x.dtype))
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """[num_rows, hidden] -> [num_rows, vocab] float32 on rank 0 (the ranks' vocab slices gathered); None on
        the other ranks, which only take part. `out`: a [num_rows, vocab] float32 buffer the head may write into
        (one rank only); use the returned tensor."""
        out = out if self.tp.world_size == 1 else None
        logits = self.tp.gather_cols(cpu_linear.forward_float32(self.lm_head, self.norm(hidden), out))
        return logits if logits is None else ops.softcap_(logits, self.args.final_softcap)

    def serves_greedy(self, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
        """compute_greedy serves `rows` rows of hidden states (dtype, device): one rank, and a head whose
        small-row kernel serves them (cpu_linear.serves_head_stats)."""
        return self.tp.world_size == 1 and self.args.final_softcap is None \
            and cpu_linear.serves_head_stats(self.lm_head, rows, dtype, device)

    def compute_greedy(self, hidden: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """[num_rows, hidden] -> per row (argmax, max logit, logsumexp) of compute_logits' logits without writing
        them (cpu_linear.head_argmax_lse); None where it does not serve (serves_greedy: tensor parallelism, CUDA,
        an int8 head, a head oneDNN serves at this many rows): the caller computes the logits."""
        if not self.serves_greedy(hidden.shape[0], hidden.dtype, hidden.device):
            return None
        return cpu_linear.head_argmax_lse(self.lm_head, self.norm(hidden))

    # ---- weights (engine/model_executor/models/llama_weights.py) ---------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF state-dict tensors (model.layers.N.self_attn.q_proj.weight, ...) into our fused params."""
        llama_weights.load_weights(self, self.args, self.tp, weights)

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights (benchmarks of big architectures with nothing to download); norms start at one."""
        llama_weights.init_dummy_weights(self, self.args, self.tp, seed)
