"""The one module that loads pagedserve's compiled ops, plus a pure-torch reference for each.

The C++/CUDA sources in csrc/ are JIT-built with torch.utils.cpp_extension on first
use and cached (in $PAGEDSERVE_CACHE, else torch's extensions dir). Where CUDA is
visible the build also holds the CUDA kernels; ops dispatch on the tensors' device.
If the build fails (no compiler, say) every op falls back to its reference, with a
warning. PAGEDSERVE_OPS_BACKEND=torch forces the reference.

Cache layout per layer: [num_blocks, num_kv_heads, block_size, head_size]; a slot is
block_id * block_size + offset and a negative slot is skipped.
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence, Union

import torch

logger = logging.getLogger("pagedserve.ops")

_SOURCES_CPU = (
    "bindings.cpp", "cpu/attention.cpp", "cpu/prefill_attention.cpp", "cpu/cache.cpp", "cpu/layernorm.cpp",
    "cpu/activation.cpp", "cpu/pos_encoding.cpp", "cpu/sampling.cpp",
)
_SOURCES_CUDA = ("cuda/attention_kernels.cu", "cuda/cache_kernels.cu", "cuda/torch_bindings.cpp")

BlockMapping = Union[torch.Tensor, Mapping[int, int], Sequence[tuple[int, int]]]


class OpsBackend(str, enum.Enum):
    """Which implementation serves the ops."""

    COMPILED_CUDA = "compiled-cuda"  # C++ CPU ops + CUDA kernels
    COMPILED_CPU = "compiled-cpu"
    TORCH_REFERENCE = "torch-reference"


# ---------------------------------------------------------------- loading

_lock = threading.Lock()
_module = None
_backend: Optional[OpsBackend] = None


def find_csrc() -> Optional[Path]:
    """csrc/ next to the engine package (source tree), else shipped as engine/_csrc or engine/csrc."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc", here / "_csrc", here / "csrc"):
        if (candidate / "ops.h").is_file():
            return candidate
    return None


def _cpu_isa_flags() -> tuple[str, list[str]]:
    # Targeted flags, not -march=native, so a cache built here stays valid on
    # any machine that has the same extensions (the ISA is part of the name).
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        flags = set()
    if not {"avx2", "fma", "f16c"} <= flags:
        return "generic", []
    avx2 = ["-mavx2", "-mfma", "-mf16c"]
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx2", avx2
    avx512 = avx2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    if "avx512_bf16" in flags:  # vdpbf16ps: bf16 dot products in the attention kernels
        return "avx512bf16", avx512 + ["-mavx512bf16"]
    return "avx512", avx512


def _want_cuda() -> bool:
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None and Path(CUDA_HOME, "bin", "nvcc").exists()


def _build(csrc: Path, with_cuda: bool):
    from torch.utils.cpp_extension import load

    isa, isa_flags = _cpu_isa_flags()
    sources = list(_SOURCES_CPU) + (list(_SOURCES_CUDA) if with_cuda else [])
    digest = hashlib.sha1()
    for rel in sorted(p.relative_to(csrc).as_posix() for p in csrc.rglob("*") if p.is_file()):
        digest.update(rel.encode() + (csrc / rel).read_bytes())
    name = f"pagedserve_{'cuda' if with_cuda else 'cpu'}_{isa}_{digest.hexdigest()[:10]}"
    root = os.environ.get("PAGEDSERVE_CACHE")
    build_dir = Path(root) / name if root else None
    if build_dir is not None:
        build_dir.mkdir(parents=True, exist_ok=True)
    else:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, verbose=False))
    if not (build_dir / f"{name}.so").exists():
        kind = "CUDA" if with_cuda else "CPU"
        logger.warning("building pagedserve %s kernels (first run, ~%s s) in %s ...",
                       kind, 180 if with_cuda else 40, build_dir)
    # -fno-trapping-math: lets gcc if-convert (and so vectorize) the clamps in csrc/cpu/vec_utils.h.
    cflags = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math", *isa_flags]
    if with_cuda:
        cflags.append("-DPAGEDSERVE_CUDA")
    return load(
        name=name,
        sources=[str(csrc / s) for s in sources],
        extra_cflags=cflags,
        extra_cuda_cflags=["-O3", "-DPAGEDSERVE_CUDA", "--use_fast_math", "-lineinfo"],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(csrc)],
        build_directory=str(build_dir),
        verbose=os.environ.get("PAGEDSERVE_VERBOSE_BUILD") == "1",
    )


def _load():
    """Builds (once) and returns the compiled module, or None for the torch reference."""
    global _module, _backend
    with _lock:
        if _backend is not None:
            return _module
        if os.environ.get("PAGEDSERVE_OPS_BACKEND", "").lower() == "torch":
            _backend = OpsBackend.TORCH_REFERENCE
            return None
        csrc = find_csrc()
        if csrc is None:
            logger.warning("pagedserve: csrc/ not found next to the engine package; using the "
                           "pure-torch reference ops (slow)")
            _backend = OpsBackend.TORCH_REFERENCE
            return None
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            logger.warning("pagedserve: no C++ compiler found; using the pure-torch reference ops (slow)")
            _backend = OpsBackend.TORCH_REFERENCE
            return None
        attempts = [True, False] if _want_cuda() else [False]
        for with_cuda in attempts:
            try:
                _module = _build(csrc, with_cuda)
                _backend = OpsBackend.COMPILED_CUDA if with_cuda else OpsBackend.COMPILED_CPU
                return _module
            except Exception as exc:  # a failed build must not take the engine down
                logger.warning("pagedserve: building the %s kernels failed (%s: %s)",
                               "CUDA" if with_cuda else "CPU", type(exc).__name__, str(exc)[-2000:])
        logger.warning("pagedserve: using the pure-torch reference ops (slow)")
        _backend = OpsBackend.TORCH_REFERENCE
        return None


def backend() -> OpsBackend:
    """Which implementation the ops use (builds the kernels if not done yet)."""
    _load()
    assert _backend is not None
    return _backend


def _compiled_for(*tensors: torch.Tensor):
    """The compiled module if it serves these tensors' device, else None."""
    module = _load()
    if module is None:
        return None
    if any(t.is_cuda for t in tensors) and _backend is not OpsBackend.COMPILED_CUDA:
        return None
    return module


def _compiled_cpu_for(*tensors: torch.Tensor):
    """The compiled module for CPU-only ops (the elementwise ones), else None: CUDA tensors use the reference."""
    if any(t.is_cuda for t in tensors):
        return None
    return _load()


def _as_mapping(block_mapping: BlockMapping) -> torch.Tensor:
    if isinstance(block_mapping, torch.Tensor):
        return block_mapping.to(device="cpu", dtype=torch.int64).reshape(-1, 2)
    pairs = list(block_mapping.items()) if isinstance(block_mapping, Mapping) else list(block_mapping)
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


# ---------------------------------------------------------------- the ops


def paged_attention(
    out: torch.Tensor,  # [num_seqs, num_heads, head_size]
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> None:
    """Decode attention of one query token per sequence over its paged context; writes out."""
    module = _compiled_for(out, query, key_cache)
    if module is None:
        return ref_paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale)
    module.paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, float(scale))


def prefill_attention(
    out: torch.Tensor,  # [q_len, num_heads, head_size], heads contiguous
    query: torch.Tensor,  # [q_len, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size] (a strided view is fine)
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_table: torch.Tensor,  # [num_seq_blocks] int32
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's q_len new tokens over the first context_len tokens of its blocks
    (a cached prefix, then the new ones); GQA without K/V copies. CPU kernel; CUDA runs the reference."""
    module = _compiled_cpu_for(query, key_cache)
    if module is None or query.dtype not in (*_ELEMENTWISE_DTYPES, torch.float16):
        return ref_prefill_attention(out, query, key_cache, value_cache, block_table, context_len, scale)
    module.prefill_attention(out, query, key_cache, value_cache, block_table, int(context_len), float(scale))
    return out


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Writes each token's K/V rows into its cache slot; negative slots are skipped."""
    module = _compiled_for(key, key_cache)
    if module is None:
        return ref_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(
    key_caches: list[torch.Tensor],  # num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    value_caches: list[torch.Tensor],  # num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    block_mapping: BlockMapping,  # [num_pairs, 2] int64 (src, dst), or {src: dst} / [(src, dst)]
) -> None:
    """Copies blocks src -> dst inside every layer's key and value cache, in pair order."""
    mapping = _as_mapping(block_mapping)
    if mapping.numel() == 0 or not key_caches:
        return
    module = _compiled_for(*key_caches[:1])
    if module is None:
        return ref_copy_blocks(key_caches, value_caches, mapping)
    module.copy_blocks(list(key_caches), list(value_caches), mapping)


def swap_blocks(
    src: torch.Tensor,  # [num_src_blocks, num_kv_heads, block_size, head_size]
    dst: torch.Tensor,  # [num_dst_blocks, num_kv_heads, block_size, head_size]
    block_mapping: BlockMapping,  # [num_pairs, 2] int64 (src, dst), or {src: dst} / [(src, dst)]
) -> None:
    """Copies blocks from one cache tensor into another (device <-> host swap pool).

    On CUDA the copies are queued on the current stream (use a side stream with
    torch.cuda.stream(...) to overlap them); the host side should be pinned.
    """
    mapping = _as_mapping(block_mapping)
    if mapping.numel() == 0:
        return
    module = _compiled_for(src, dst)
    if module is None:
        return ref_swap_blocks(src, dst, mapping)
    module.swap_blocks(src, dst, mapping)


# Elementwise ops of a Llama block: one pass each, float32 math inside, on the calling thread for
# decode-sized batches (an OpenMP wake-up costs more than the work). CPU kernels; CUDA runs the reference.


def rms_norm(
    out: torch.Tensor,  # [num_tokens, hidden], rows contiguous
    x: torch.Tensor,  # [num_tokens, hidden], rows contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:
    """out = weight * x / rms(x) row by row, as HF's LlamaRMSNorm rounds it; returns out."""
    module = _compiled_cpu_for(x)
    if module is None or x.dtype not in _ELEMENTWISE_DTYPES:
        return ref_rms_norm(out, x, weight, eps)
    module.rms_norm(out, x, weight, float(eps))
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]; overwritten with the normalised sum
    residual: torch.Tensor,  # [num_tokens, hidden]; overwritten with residual + x
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> None:
    """In place: residual += x, then x = rms_norm(residual) (the two halves of a Llama block's hand-off)."""
    module = _compiled_cpu_for(x, residual)
    if module is None or x.dtype not in _ELEMENTWISE_DTYPES:
        return ref_fused_add_rms_norm(x, residual, weight, eps)
    module.fused_add_rms_norm(x, residual, weight, float(eps))


def silu_and_mul(
    out: torch.Tensor,  # [num_tokens, d]
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate | up
) -> torch.Tensor:
    """out = silu(gate) * up; returns out."""
    module = _compiled_cpu_for(x)
    if module is None or x.dtype not in _ELEMENTWISE_DTYPES:
        return ref_silu_and_mul(out, x)
    module.silu_and_mul(out, x)
    return out


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    x: torch.Tensor,  # [num_tokens, num_heads, head_size], head vectors contiguous (a strided view is fine)
    cos_sin_cache: torch.Tensor,  # [max_position, head_size] float32: cos halves | sin halves
) -> None:
    """Neox-style RoPE in place on every head of x at its token's position."""
    module = _compiled_cpu_for(x)
    if module is None or x.dtype not in _ELEMENTWISE_DTYPES:
        return ref_rotary_embedding(positions, x, cos_sin_cache)
    module.rotary_embedding(positions, x, cos_sin_cache)


_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)


@contextlib.contextmanager
def thread_omp_threads(n: int) -> Iterator[None]:
    """OpenMP threads of the parallel regions that THIS thread opens in the block (compiled ops and oneDNN GEMMs).
    Without the compiled module it changes nothing (torch.set_num_threads would change every thread)."""
    module = _load()
    if module is None:
        yield
        return
    previous = module.set_thread_omp_threads(n)
    try:
        yield
    finally:
        module.set_thread_omp_threads(previous)


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [rows, vocab] logits: (the first index of the largest, int64 [rows]; logsumexp, float32 [rows]).

    Greedy decoding's token and the sampled token's logprob (logit - logsumexp) from one read of each row."""
    module = _compiled_cpu_for(logits)
    if module is None or logits.dtype not in _ELEMENTWISE_DTYPES or logits.dim() != 2 or logits.stride(-1) != 1:
        return ref_argmax_logsumexp(logits)
    argmax = torch.empty(logits.shape[0], dtype=torch.int64)
    lse = torch.empty(logits.shape[0], dtype=torch.float32)
    module.argmax_logsumexp(logits, argmax, lse)
    return argmax, lse


# ---------------------------------------------------------------- references (the test oracle)


def ref_rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, round to the input dtype, then scale (rounded again)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return out.copy_(weight * normed.to(x.dtype))


def ref_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual += x (in its dtype), then x = rms_norm(residual)."""
    residual.add_(x)
    ref_rms_norm(x, residual, weight, eps)


def ref_silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in the input's dtype, as torch's F.silu(gate) * up rounds it."""
    gate, up = x.chunk(2, dim=-1)
    return out.copy_(torch.nn.functional.silu(gate) * up)


def ref_rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """HF's x * cos + rotate_half(x) * sin in x's dtype, written back into x."""
    cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, head_size // 2]
    x1, x2 = x.chunk(2, dim=-1)
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def ref_argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.argmax(dim=-1), logits.float().logsumexp(dim=-1)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_table: torch.Tensor,  # [num_seq_blocks] int32
    context_len: int,
) -> torch.Tensor:  # [num_kv_heads, context_len, head_size]
    """One sequence's first context_len cached K (or V) rows, in order, copied out of its blocks."""
    blocks = cache[block_table.long().to(cache.device)]  # [num_seq_blocks, num_kv_heads, block_size, head_size]
    num_kv_heads, head_size = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(num_kv_heads, -1, head_size)[:, :context_len]


def ref_paged_attention(
    out: torch.Tensor,  # [num_seqs, num_heads, head_size]
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> None:
    """Plain-torch paged decode attention, float32 math, one sequence at a time."""
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    for i, n in enumerate(context_lens.tolist()):
        if n == 0:  # nothing cached: defined as zeros
            out[i].zero_()
            continue
        table = block_tables[i, : (n + block_size - 1) // block_size]

        def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [num_heads, n, head_size]
            return gather_context(cache, table, n).float().repeat_interleave(group, dim=0)

        scores = torch.einsum("hd,hnd->hn", query[i].float(), gather(key_cache)) * scale
        probs = torch.softmax(scores, dim=-1)  # softmax subtracts the max: safe
        out[i] = torch.einsum("hn,hnd->hd", probs, gather(value_cache)).to(out.dtype)


def ref_prefill_attention(
    out: torch.Tensor,  # [q_len, num_heads, head_size]
    query: torch.Tensor,  # [q_len, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_table: torch.Tensor,  # [num_seq_blocks] int32
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """SDPA in float32 over the gathered context, with GQA copies and a causal mask offset by the cached prefix."""
    q_len, group = query.shape[0], query.shape[1] // key_cache.shape[1]

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [num_heads, context_len, head_size]
        return gather_context(cache, block_table, context_len).float().repeat_interleave(group, dim=0)

    mask = torch.ones(q_len, context_len, dtype=torch.bool, device=query.device).tril(context_len - q_len)
    attn = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(0, 1), gather(key_cache), gather(value_cache), attn_mask=mask, scale=scale)
    return out.copy_(attn.transpose(0, 1))


def ref_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Plain-torch slot writes."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(key_cache.device)
    blocks, offsets = slots // block_size, slots % block_size
    # Indices split by a slice put the token dim first: [n, num_kv_heads, head_size].
    key_cache[blocks, :, offsets] = key[keep.to(key.device)]
    value_cache[blocks, :, offsets] = value[keep.to(value.device)]


def ref_copy_blocks(
    key_caches: list[torch.Tensor],  # num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    value_caches: list[torch.Tensor],  # num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    block_mapping: BlockMapping,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Plain-torch block copies, pair by pair, every layer."""
    for src, dst in _as_mapping(block_mapping).tolist():
        for cache in (*key_caches, *value_caches):
            cache[dst].copy_(cache[src])


def ref_swap_blocks(
    src: torch.Tensor,  # [num_src_blocks, ...]
    dst: torch.Tensor,  # [num_dst_blocks, ...]
    block_mapping: BlockMapping,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Plain-torch block copies between two tensors (any devices)."""
    for s, d in _as_mapping(block_mapping).tolist():
        dst[d].copy_(src[s])
