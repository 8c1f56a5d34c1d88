"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) on a flattened, unpadded batch and the paged KV cache."""
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
from engine.model_executor.models.llama_args import ModelArgs
import engine.model_executor.models.llama_weights as llama_weights

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_inv_freq(hf_config, head_dim: int, max_len: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies [head_dim // 2] and the cos/sin scale, as HF computes them for the config."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    with torch.device("cpu"):  # the model may be built under torch.device("meta")
        return _inv_freq(hf_config, rope_type, params, head_dim, max_len)


def _inv_freq(hf_config, rope_type: str, params: dict, head_dim: int, max_len: int) -> tuple[torch.Tensor, float]:
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # dynamic NTK is frozen at the longest length we serve (HF rescales per batch, which a cache cannot follow).
    seq_len = max(max_len, getattr(hf_config, "max_position_embeddings", max_len)) if rope_type == "dynamic" else None
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), seq_len=seq_len)
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) from a cos/sin table built on first use on the model's device."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, max_len: int) -> None:
        super().__init__()
        self.inv_freq, self.scale, self.max_len = inv_freq, scale, max_len
        self._cos_sin: Optional[torch.Tensor] = None  # [max_len, head_dim] float32: cos halves | sin halves

    def table(self, device: torch.device) -> torch.Tensor:  # [max_len, head_dim] float32
        if self._cos_sin is None or self._cos_sin.device != device:
            t = torch.arange(self.max_len, dtype=torch.float32, device="cpu")
            freqs = torch.outer(t, self.inv_freq)  # [max_len, head_dim // 2]
            self._cos_sin = torch.cat([freqs.cos() * self.scale, freqs.sin() * self.scale], dim=-1).to(device)
        return self._cos_sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        # positions: [num_tokens]; x: [num_tokens, heads, head_dim], rotated in place with HF's arithmetic.
        ops.rotary_embedding(positions, x, self.table(x.device))


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
        self.tp = tp
        self.heads, self.kv_heads = a.num_heads // tp.world_size, a.local_kv_heads(tp.world_size)
        self.head_dim = a.head_dim
        self.q_size, self.kv_size = self.heads * a.head_dim, self.kv_heads * a.head_dim
        # q, k and v in one matmul: fewer, larger GEMMs are faster on CPU and GPU alike.
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.o_bias, dtype=dtype)
        self.rotary = rotary
        self.attn = Attention(self.heads, self.kv_heads, a.head_dim, scale=a.head_dim**-0.5,
                              sliding_window=sliding_window)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: Optional[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:  # x: [num_tokens, hidden]; positions: [num_tokens]
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.heads + self.kv_heads, self.head_dim)
        self.rotary(positions, qk)  # q and k rotated together, in place
        # Strided views, no copies: the cache and attention ops only need each head's vector contiguous.
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)  # [num_tokens, heads, head_dim]
        return self.tp.all_reduce(self.o_proj(out.view(t, self.q_size)))  # each rank's heads' share, summed


class LlamaMLP(nn.Module):
    """SwiGLU over this rank's columns: gate_up_proj column-parallel, down_proj row-parallel (+ all-reduce)."""

    def __init__(self, a: ModelArgs, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.inter = a.intermediate_size // tp.world_size
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * self.inter, bias=a.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(self.inter, a.hidden_size, bias=a.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * inter]: gate | up
        act = ops.silu_and_mul(gate_up.new_empty(x.shape[0], self.inter), gate_up)
        return self.tp.all_reduce(self.down_proj(act))


class LlamaBlock(nn.Module):
    def __init__(self, a: ModelArgs, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: Optional[int], tp: TPGroup, sparse: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(a, rotary, dtype, sliding_window, tp)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        # a mixture-of-experts model's sparse layers: the router and its experts (engine/model_executor/layers/moe.py)
        self.mlp = MoEMLP(a.hidden_size, a.moe, dtype, tp) if sparse else LlamaMLP(a, dtype, tp)

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
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder whose forward runs one flattened batch of tokens from many sequences.

    Under tensor parallelism (tp.world_size N > 1) this is one rank's shard: 1/N of the heads, key/value heads
    and MLP columns, and 1/N of the vocabulary in the embedding and the head; the norms are whole on every rank.
    """

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32, max_len: Optional[int] = None,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        a = self.args = ModelArgs.from_hf(hf_config)
        self.tp = tp = tp or TPGroup.single()
        a.check_tensor_parallel(tp.world_size)
        self.vocab_start, self.vocab_end = tp.shard(a.vocab_size)
        self.dtype = dtype
        max_len = max_len or getattr(hf_config, "max_position_embeddings", 2048)
        inv_freq, scale = rope_inv_freq(hf_config, a.head_dim, max_len)
        self.rotary = RotaryEmbedding(inv_freq.to("cpu"), scale, max_len)
        local_vocab = self.vocab_end - self.vocab_start
        # _weight: no random init (on the meta device torch's normal_ imports torch._dynamo and triton: +100 MiB RSS).
        self.embed_tokens = nn.Embedding(local_vocab, a.hidden_size, dtype=dtype,
                                         _weight=torch.empty(local_vocab, a.hidden_size, dtype=dtype))
        sparse = a.moe.sparse_layers if a.moe is not None else (False,) * a.num_layers
        self.layers = nn.ModuleList(LlamaBlock(a, self.rotary, dtype, w, tp, s) for w, s in zip(a.layer_windows, sparse))
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
            self._compiled_plan = CompiledDecode.build(self.layers, self.args.layer_windows, self.args.rms_norm_eps)
        return self._compiled_plan

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
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
        return self.tp.gather_cols(cpu_linear.forward_float32(self.lm_head, self.norm(hidden), out))

    def serves_greedy(self, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
        """compute_greedy serves `rows` rows of hidden states (dtype, device): one rank, and a head whose
        small-row kernel serves them (cpu_linear.serves_head_stats)."""
        return self.tp.world_size == 1 and cpu_linear.serves_head_stats(self.lm_head, rows, dtype, device)

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
