"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) on a flattened, unpadded batch and the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from engine import ops
from engine.attention import Attention, AttentionMetadata, KVCache
from engine.distributed import TPGroup

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass
class ModelArgs:
    """The fields of an HF config this model reads, checked once."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama attention_bias only
    mlp_bias: bool
    tie_word_embeddings: bool
    layer_windows: tuple[Optional[int], ...]  # per layer: its sliding window in tokens, None for full attention

    @classmethod
    def from_hf(cls, c) -> "ModelArgs":
        if getattr(c, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c.hidden_act!r} is not supported (only silu).")
        qwen2 = getattr(c, "model_type", "") == "qwen2"
        bias = bool(getattr(c, "attention_bias", False))
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps,
            qkv_bias=qwen2 or bias,
            o_bias=bias and not qwen2,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            layer_windows=sliding_windows(c),
        )

    def check_tensor_parallel(self, world_size: int) -> None:
        """ValueError, at startup, when the model cannot be split evenly over world_size ranks (Megatron-style:
        each rank holds 1/N of the heads, key/value heads, MLP columns and vocabulary)."""
        sizes = {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                 "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size}
        bad = [f"{name} ({n})" for name, n in sizes.items() if n % world_size]
        if bad:
            raise ValueError(f"--tensor-parallel-size {world_size} must divide the model's {', '.join(bad)}: "
                             "each rank holds an equal share of them. Choose a size that divides them.")


def sliding_windows(c) -> tuple[Optional[int], ...]:
    """Each layer's sliding window as HF applies it: Mistral's on every layer, Qwen2's on its
    "sliding_attention" layer_types (only with use_sliding_window), None elsewhere."""
    window = getattr(c, "sliding_window", None)
    if not window or not getattr(c, "use_sliding_window", True):
        return (None,) * c.num_hidden_layers
    layer_types = getattr(c, "layer_types", None)
    if layer_types is None:
        return (int(window),) * c.num_hidden_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


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
        self.heads, self.kv_heads = a.num_heads // tp.world_size, a.num_kv_heads // tp.world_size
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
                 sliding_window: Optional[int], tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(a, rotary, dtype, sliding_window, tp)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(a, dtype, tp)

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
        self.embed_tokens = nn.Embedding(local_vocab, a.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaBlock(a, self.rotary, dtype, w, tp) for w in a.layer_windows)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(a.hidden_size, local_vocab, bias=False, dtype=dtype)
        self.tie_weights()

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
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, kv_caches[i] if kv_caches is not None else None, meta)
        return x if residual is None else residual.add_(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.tp.world_size == 1:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: each rank looks up the ids in its slice, zeros the others' rows; the sum has them all.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [num_tokens]
        local_ids = (input_ids - self.vocab_start).clamp_(0, self.vocab_end - self.vocab_start - 1)
        x = self.embed_tokens(local_ids)
        x.mul_(mine.unsqueeze(1).to(x.dtype))
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """[num_rows, hidden] -> [num_rows, vocab] float32 on rank 0 (the ranks' vocab slices gathered); None on
        the other ranks, which only take part."""
        return self.tp.gather_cols(self.lm_head(self.norm(hidden)).float())

    # ---- weights -------------------------------------------------------------------------------------------
    def _fused_targets(self, name: str) -> Optional[tuple[str, int, int]]:
        """HF name -> (our fused param, row offset, rows) for q/k/v and gate/up, this rank's sizes; None for a
        plain name."""
        a, n = self.args, self.tp.world_size
        q, kv, inter = a.num_heads * a.head_dim // n, a.num_kv_heads * a.head_dim // n, a.intermediate_size // n
        shards = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        for hf_part, (ours, offset, rows) in shards.items():
            if f".{hf_part}." in name:
                return name.replace(hf_part, ours), offset, rows
        return None

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole checkpoint tensor (our param name; the tensor itself at world_size 1).

        Column-parallel (q/k/v, gate/up, the vocab of embedding and head): rows split. Row-parallel (o_proj,
        down_proj): columns split, and the bias kept by rank 0 alone, so the all-reduce adds it once."""
        tp = self.tp
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

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF state-dict tensors (model.layers.N.self_attn.q_proj.weight, ...) into our fused params."""
        params = dict(self.named_parameters())
        rows_loaded = dict.fromkeys(params, 0)
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue  # tied: the embedding is the head
            fused = self._fused_targets(name)
            name, offset = fused[:2] if fused is not None else (name, 0)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}.")
            tensor = self._shard(name, tensor)
            rows = tensor.shape[0]
            params[name][offset : offset + rows].copy_(tensor)
            rows_loaded[name] += rows
        missing = [n for n, p in params.items() if rows_loaded[n] != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing or duplicates tensors for {len(missing)} params, e.g. {missing[:3]}.")

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights (benchmarks of big architectures with nothing to download); norms start at one.
        The whole model's tensors are drawn and then sharded, so every tensor-parallel size runs the same model."""
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def tensors() -> Iterable[tuple[str, torch.Tensor]]:
            for name, shape in self._checkpoint_shapes():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    yield name, torch.ones(shape)
                else:
                    yield name, torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02)

        self.load_weights(tensors())

    def _checkpoint_shapes(self) -> Iterable[tuple[str, tuple[int, ...]]]:
        """(HF name, whole shape) of every checkpoint tensor of this architecture."""
        a = self.args
        h, q, kv, inter = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        yield "embed_tokens.weight", (a.vocab_size, h)
        for i in range(a.num_layers):
            attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            yield f"layers.{i}.input_layernorm.weight", (h,)
            yield f"layers.{i}.post_attention_layernorm.weight", (h,)
            for part, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield f"{attn}{part}.weight", (rows, h)
                if a.qkv_bias:
                    yield f"{attn}{part}.bias", (rows,)
            yield f"{attn}o_proj.weight", (h, q)
            if a.o_bias:
                yield f"{attn}o_proj.bias", (h,)
            for part, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                yield f"{mlp}{part}.weight", shape
                if a.mlp_bias:
                    yield f"{mlp}{part}.bias", shape[:1]
        yield "norm.weight", (h,)
        if not a.tie_word_embeddings:
            yield "lm_head.weight", (a.vocab_size, h)
