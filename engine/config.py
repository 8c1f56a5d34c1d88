"""One EngineConfig, validated once; the CLI and the LLM class map onto it."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Optional, Union

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
# max_num_batched_tokens with chunked prefill, as vLLM's: the longest step a decode waits for is one this long.
CHUNKED_PREFILL_TOKENS = 512


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


BLOCK_SIZES = (8, 16, 32, 64, 128)
# --quantization: int8 is Q8_0; q4_k ... llama.cpp's other block types (engine/model_executor/layers/ggml_linears.py)
QUANTIZATIONS = ("int8", "q4_k", "q4_0", "q4_1", "q5_0", "q5_1", "q5_k", "q6_k", "fp8", "none")
CUDA_BLOCK_SIZES = (8, 16, 32)  # vLLM's; the CUDA kernels were tested at these
CUDA_BLOCK_SIZE = 16
# On CPU a decode step reads each sequence's K and V cold from memory, one block's run per kv head at a time:
# 128-token runs instead of 16-token ones took a 32-stream bfloat16 decode step from 46.6 to 41.7 ms (8 streams
# 15.5 -> 14.5 ms, one stream level; docs/benchmarks.md). vLLM's CPU backend with IPEX defaults to 128 too. The
# price: the prefix cache shares whole blocks only, so prefixes shorter than 128 tokens are not reused.
CPU_BLOCK_SIZE = 128


@dataclass
class EngineConfig:
    """Every engine knob, with vLLM's names and defaults. Fields the model decides stay None until resolved."""

    model: Optional[str] = None  # HF folder, .gguf file, or None for the default SmolLM2
    served_model_name: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    # Weights as int8 (llama.cpp's Q8_0 blocks, engine/model_executor/layers/quant.py; CPU only). None: float weights, except a GGUF
    # whose weights are Q8_0, which is served as it is (not dequantized); "int8": quantize a float checkpoint at
    # load; "none": float weights always (a Q8_0 GGUF dequantized, as before).
    quantization: Optional[str] = None
    max_model_len: Optional[int] = None
    block_size: Optional[int] = None  # tokens per KV block; None: CPU_BLOCK_SIZE on CPU, CUDA_BLOCK_SIZE on CUDA
    gpu_memory_utilization: float = 0.90
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks
    kv_cache_space: float = 4.0  # GiB of KV cache on CPU
    num_gpu_blocks_override: Optional[int] = None
    num_cpu_blocks_override: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: bool = False
    # Steps mix decodes with prompt chunks under max_num_batched_tokens (default then 512), so a long prompt
    # no longer stalls every running stream for a whole prefill.
    enable_chunked_prefill: bool = False
    preemption_mode: Optional[PreemptionMode] = None  # None: recompute for one seq, swap for several
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    watermark: float = 0.01
    max_logprobs: int = 20  # the most alternatives a request's logprobs may ask for; -1: no bound (the vocabulary)
    # Ranks that each hold 1/N of the model (engine/worker/tp_workers.py); on CPU each gets 1/N of the cores.
    tensor_parallel_size: int = 1
    # Seconds the ranks wait for each other to start, and at most in any one collective.
    distributed_timeout: float = 120.0
    # Every step op by op (the reference). Off: a CPU step runs its decoder layers in one compiled call
    # (engine/model_executor/models/compiled_decode.py), bit-identical; a CUDA decode-only step replays a CUDA graph
    # captured for its batch size (engine/worker/cuda_graphs.py), the same tokens.
    enforce_eager: bool = False
    # MiB of compiled structured-output grammars kept (engine/structured_output/grammars.py), least recently used dropped first:
    # every distinct schema, regex or grammar a client sends is a new one (tens of KiB to MiBs each, growing
    # with the vocabulary), so the bound is in bytes. 0: nothing is kept, every constrained request compiles.
    grammar_cache_mb: float = 16.0
    # A running request's output is reported every this many steps (and always with its first token and at its
    # end), as vLLM's and SGLang's --stream-interval: a streamed client gets one SSE event for each N tokens, so the
    # API server's per-event work (and the core's output encoding) falls N-fold at high concurrency. 1: each token.
    stream_interval: int = 1
    # Speculative decoding (engine/spec_decode/): vLLM's JSON, {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m} or {"model": PATH, "num_speculative_tokens": k}; a dict or
    # its JSON text, parsed into a SpeculativeConfig here. None: no speculation.
    speculative_config: Optional["SpeculativeConfig"] = None
    # vLLM's --generation-config: "auto" applies the model folder's generation_config.json sampling defaults
    # (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) to what a request leaves unset;
    # "vllm": none of them; or a folder holding such a file (engine/generation_config.py).
    generation_config: str = "auto"
    # vLLM's --override-generation-config: a dict (or its JSON text) of those keys laid over them.
    override_generation_config: Optional[Union[str, dict]] = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if isinstance(self.preemption_mode, str):
            self.preemption_mode = PreemptionMode(self.preemption_mode)
        if isinstance(self.scheduling_policy, str):
            self.scheduling_policy = SchedulingPolicy(self.scheduling_policy)
        checks = [
            ("block_size", self.block_size in (None, *BLOCK_SIZES), "must be 8, 16, 32, 64 or 128"),
            ("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16"), "must be auto, float32, bfloat16 or float16"),
            ("device", self.device in ("auto", "cpu", "cuda"), "must be auto, cpu or cuda"),
            ("load_format", self.load_format in ("auto", "safetensors", "gguf", "dummy"), "must be auto, safetensors, gguf or dummy"),
            ("quantization", self.quantization in (None, *QUANTIZATIONS), "must be " + ", ".join(QUANTIZATIONS)),
            ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "must be in (0, 1]"),
            ("swap_space", self.swap_space >= 0, "must be >= 0"),
            ("kv_cache_space", self.kv_cache_space > 0, "must be > 0"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_logprobs", self.max_logprobs >= -1, "must be >= 0, or -1 (no bound)"),
            ("watermark", 0.0 <= self.watermark < 1.0, "must be in [0, 1)"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, "must be >= 1"),
            ("distributed_timeout", self.distributed_timeout > 0, "must be > 0"),
            ("grammar_cache_mb", self.grammar_cache_mb >= 0, "must be >= 0"),
            ("stream_interval", self.stream_interval >= 1, "must be >= 1"),
        ]
        for name, ok, msg in checks:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")
        for name in ("num_gpu_blocks_override", "num_cpu_blocks_override", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1 and not (name == "num_cpu_blocks_override" and value == 0):
                raise ValueError(f"{name} must be positive, got {value}.")
        if self.device != "auto":
            self.resolve_block_size(self.device)

    def resolve_block_size(self, device_type: str) -> None:
        """The device's default block size unless one was given (LLMEngine calls this once "auto" is a device)."""
        if self.block_size is None:
            self.block_size = CPU_BLOCK_SIZE if device_type == "cpu" else CUDA_BLOCK_SIZE
        elif device_type == "cuda" and self.block_size not in CUDA_BLOCK_SIZES:
            raise ValueError(f"block_size must be 8, 16 or 32 on CUDA, got {self.block_size} (64 and 128: CPU only).")

    @property
    def model_name(self) -> str:
        """The id clients use in the `model` field."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_MODEL_ID
        return self.model.rstrip("/").split("/")[-1]

    def resolve(self, model_max_len: int) -> None:
        """Fill the fields the model decides, and check them against each other."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.max_num_batched_tokens is None:
            if self.enable_chunked_prefill:
                self.max_num_batched_tokens = max(CHUNKED_PREFILL_TOKENS, self.max_num_seqs)
            else:
                self.max_num_batched_tokens = max(self.max_model_len, 2048)
        if self.max_num_batched_tokens < self.max_model_len and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}): a full-length prompt could never be scheduled. "
                "Raise --max-num-batched-tokens, lower --max-model-len, or --enable-chunked-prefill."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})."
            )


# The most tokens a step may propose per sequence: each is a row of the verifying forward.
MAX_SPECULATIVE_TOKENS = 16

_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_num_layers"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How proposals are made: `method` "ngram" (prompt lookup over the prompt and the output so far) or
    "draft_model" (`model`, a checkpoint with the target's tokenizer, run on the same paged engine code with its own
    small KV cache). `draft_num_layers` (pagedserve's, not vLLM's): the draft keeps only the first N decoder layers
    of `model` and its head (a self-speculative draft when `model` is the target)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Optional[str] = None
    draft_num_layers: Optional[int] = None

    @classmethod
    def parse(cls, value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """From the flag's JSON text or a dict; ValueError naming what is wrong (the server exits with it)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON ({exc.msg} at character {exc.pos}).") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: expected a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}.')
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(_KEYS)}.")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: method must be \"ngram\" or \"draft_model\" (or give \"model\"), "
                             f"got {value.get('method')!r}.")
        k = value.get("num_speculative_tokens")
        _int_in("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        kwargs: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
        if method == "ngram":
            if "model" in value or "draft_num_layers" in value:
                raise ValueError("speculative_config: method \"ngram\" takes no model.")
            hi, lo = value.get("prompt_lookup_max", 4), value.get("prompt_lookup_min", 1)
            _int_in("prompt_lookup_max", hi, 1, 64)
            _int_in("prompt_lookup_min", lo, 1, 64)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi}).")
            kwargs.update(prompt_lookup_max=hi, prompt_lookup_min=lo)
        else:
            if not isinstance(value.get("model"), str) or not value["model"]:
                raise ValueError("speculative_config: method \"draft_model\" needs \"model\": a checkpoint path.")
            if "prompt_lookup_max" in value or "prompt_lookup_min" in value:
                raise ValueError("speculative_config: prompt_lookup_* apply to method \"ngram\" only.")
            layers = value.get("draft_num_layers")
            if layers is not None:
                _int_in("draft_num_layers", layers, 1, 1 << 10)
            kwargs.update(model=value["model"], draft_num_layers=layers)
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if v is not None})


def _int_in(name: str, value: Any, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"speculative_config: {name} must be an integer in [{lo}, {hi}], got {value!r}.")
