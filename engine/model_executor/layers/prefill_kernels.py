"""Prefill attention on CUDA: the kernel that runs a step's prompt spans, picked once per engine by a probe.

Candidates, best first: torch's variable-length flash attention (torch.nn.attention.varlen, torch >= 2.10),
xformers' memory-efficient attention (where installed), and SDPA one sequence at a time (always). Each is run
once at engine start on a tiny batch laid out as the model's (strided q/k/v views of one qkv row, GQA, the
model's dtype) on the engine's device and compared with float32 math. A kernel that is installed but cannot run
there, such as PyPI's xformers on a torch it was not built for ("NotImplementedError: No operator found for
memory_efficient_attention_forward"), gets one warning, and the next candidate serves.

Every kernel computes the same thing: causal attention within each span, the spans packed back to back, no
cached prefix, no sliding window. Steps with a cached prefix and windowed layers take engine/model_executor/layers/attention.py's
per-sequence SDPA path with an explicit mask.
"""
from __future__ import annotations

import inspect
import itertools
import logging
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger("pagedserve.attention")

PROBE_SEQ_LENS = (3, 5)  # two spans: a kernel that ignores the spans' boundaries fails the probe


class PrefillKernel:
    """One way to run packed causal prefill spans: prepare() once per step, then one call per layer."""

    name = "?"
    fix = ""  # what a user does about a failed probe, if anything
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)  # what it is built for

    def prepare(self, seq_lens: list[int], device: torch.device) -> Any:
        """The step's per-kernel input (cumulative lengths, a mask), built once and shared by every layer."""
        return seq_lens

    def __call__(self, query: torch.Tensor,  # [num_tokens, num_heads, head_size]
                 key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
                 value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
                 prepared: Any, scale: float) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        raise NotImplementedError


# SDPA's enable_gqa (torch >= 2.5) shares each K/V head with its query heads without copying them.
_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def sdpa(query: torch.Tensor,  # [q_len, num_heads, head_size]
         key: torch.Tensor,  # [kv_len, num_kv_heads, head_size]
         value: torch.Tensor,  # [kv_len, num_kv_heads, head_size]
         mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:  # [q_len, num_heads, head_size]
    """One sequence's attention through SDPA: causal (top-left) without a mask; GQA by SDPA's own enable_gqa."""
    q, k, v = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)  # [heads, len, head_size]
    groups = q.shape[0] // k.shape[0]
    gqa = {}
    if groups > 1 and _SDPA_GQA:
        gqa["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                         is_causal=mask is None, scale=scale, **gqa)[0]
    return out.transpose(0, 1)


class SdpaPerSequence(PrefillKernel):
    """SDPA on each span in turn: runs wherever torch does; one kernel launch per span and layer."""

    name = "SDPA per sequence"

    def __call__(self, query, key, value, prepared: list[int], scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        start = 0
        for n in prepared:
            rows = slice(start, start + n)
            out[rows] = sdpa(query[rows], key[rows], value[rows], None, scale)
            start += n
        return out


class VarlenFlash(PrefillKernel):
    """torch's variable-length flash attention: every span in one launch, GQA without copies."""

    name = "torch varlen flash attention"
    dtypes = (torch.float16, torch.bfloat16)  # flash attention has no float32 kernel

    def __init__(self, attn=None) -> None:
        if attn is None:
            from torch.nn.attention.varlen import varlen_attn as attn  # ImportError before torch 2.10
        self._attn = attn
        # The keyword set changed between releases: causal was is_causal=True in 2.10, window_size=(-1, 0)
        # since; enable_gqa is needed where it exists (without it, flash takes fewer K/V heads as they are).
        params = inspect.signature(attn).parameters
        self._kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        if "enable_gqa" in params:
            self._kwargs["enable_gqa"] = True
        self._has_scale = "scale" in params

    def prepare(self, seq_lens: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
        cu_seqlens = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32)  # [num_spans + 1]
        return cu_seqlens.to(device, non_blocking=True), max(seq_lens)

    def __call__(self, query, key, value, prepared: tuple[torch.Tensor, int], scale: float) -> torch.Tensor:
        cu_seqlens, max_len = prepared
        kwargs = dict(self._kwargs)
        if self._has_scale:
            kwargs["scale"] = scale
        else:  # flash's own scale is head_size ** -0.5
            query = query * (scale * query.shape[-1] ** 0.5)
        return self._attn(query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


class Xformers(PrefillKernel):
    """xformers' memory-efficient attention under a block-diagonal causal mask: every span in one launch."""

    name = "xformers memory_efficient_attention"
    fix = "install the xformers build made for this torch and CUDA, or uninstall xformers"

    def __init__(self, op=None, mask=None) -> None:
        if op is None:
            from xformers.ops import memory_efficient_attention_forward as op
        if mask is None:
            from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask as mask
        self._op, self._mask = op, mask

    def prepare(self, seq_lens: list[int], device: torch.device) -> Any:
        return self._mask.from_seqlens(seq_lens)

    def __call__(self, query, key, value, prepared: Any, scale: float) -> torch.Tensor:
        # [1, num_tokens, kv_heads, groups, head_size]: GQA through a broadcast 5-D view (no copy).
        t, num_heads, head_size = query.shape
        kv_heads = key.shape[1]
        groups = num_heads // kv_heads
        q = query.view(1, t, kv_heads, groups, head_size)
        k = key[:, :, None, :].expand(t, kv_heads, groups, head_size).unsqueeze(0)
        v = value[:, :, None, :].expand(t, kv_heads, groups, head_size).unsqueeze(0)
        return self._op(q, k, v, attn_bias=prepared, scale=scale).view(t, num_heads, head_size)


def installed_kernels() -> list[PrefillKernel]:
    """The candidates this torch and its packages offer, best first; SDPA per sequence always last."""
    kernels: list[PrefillKernel] = []
    for make in (VarlenFlash, Xformers):
        try:
            kernels.append(make())
        except ImportError:  # not in this torch, or not installed: nothing to say
            pass
        except Exception as exc:  # installed, but broken on import (a build for another torch)
            logger.warning("prefill attention: %s is installed but does not import (%s); not used",
                           make.name, _one_line(exc))
    return kernels + [SdpaPerSequence()]


def candidates_for(device: torch.device) -> list[PrefillKernel]:
    """The kernels a CUDA engine probes; none on the CPU, whose compiled prefill kernel serves every step."""
    return installed_kernels() if torch.device(device).type == "cuda" else []


def _one_line(exc: BaseException) -> str:
    """An exception in one line: its first line and, for xformers' long listing, its last (the reason)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    return f"{type(exc).__name__}: {text[:200]}"


def _reference(query, key, value, seq_lens: Sequence[int], scale: float) -> torch.Tensor:
    """Causal attention per span in float32 math, GQA by explicit copies: the probe's oracle."""
    groups = query.shape[1] // key.shape[1]
    out, start = [], 0
    for n in seq_lens:
        q, k, v = (t[start:start + n].float().transpose(0, 1) for t in (query, key, value))
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = (q @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))
        start += n
    return torch.cat(out)


class ProbeShape(NamedTuple):
    """What a probe batch copies from the model: its attention heads and dtype, and the engine's device."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    device: torch.device


def probe(kernel: PrefillKernel, shape: ProbeShape) -> None:
    """Runs `kernel` once on a tiny batch laid out as the model's; raises whatever it raises, or a RuntimeError
    when its output is not causal attention within each span."""
    heads, kv_heads, d = shape.num_heads, shape.num_kv_heads, shape.head_size
    t = sum(PROBE_SEQ_LENS)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(shape.device, shape.dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)  # as LlamaAttention slices its qkv
    q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    scale = d ** -0.5
    got = kernel(q, k, v, kernel.prepare(list(PROBE_SEQ_LENS), shape.device), scale)
    want = _reference(q, k, v, PROBE_SEQ_LENS, scale)
    tol = 1e-4 if shape.dtype == torch.float32 else 3e-2
    if tuple(got.shape) != tuple(want.shape) or not torch.allclose(got.float(), want, atol=tol, rtol=tol):
        raise RuntimeError("its output differs from causal attention per sequence")


def select_prefill_kernel(candidates: Sequence[PrefillKernel], shape: ProbeShape) -> Optional[PrefillKernel]:
    """The first candidate whose probe passes on shape.device; one warning for each that fails before it.
    None when there are no candidates (the CPU); RuntimeError when none runs."""
    failures = []
    for i, kernel in enumerate(candidates):
        if shape.dtype not in kernel.dtypes:  # not a failure: the kernel is not meant for this dtype
            logger.info("prefill attention: %s does not take %s; trying the next", kernel.name, shape.dtype)
            continue
        try:
            probe(kernel, shape)
        except Exception as exc:  # any failure of the kernel is a reason to use the next one
            failures.append(f"{kernel.name}: {_one_line(exc)}")
            after = candidates[i + 1].name if i + 1 < len(candidates) else "nothing"
            logger.warning("prefill attention: %s cannot run on %s with torch %s (%s); using %s instead%s",
                           kernel.name, shape.device, torch.__version__, _one_line(exc), after,
                           f" ({kernel.fix})" if kernel.fix else "")
            continue
        logger.info("prefill attention on %s: %s", shape.device, kernel.name)
        return kernel
    if failures:
        raise RuntimeError(f"no prefill attention kernel runs on {shape.device}: " + "; ".join(failures))
    return None


class PrefillBatch(NamedTuple):
    """A step's prefill spans as the engine's kernel takes them (engine/model_executor/layers/attention.py runs it in each layer)."""

    kernel: PrefillKernel
    prepared: Any

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        return self.kernel(query, key, value, self.prepared, scale)
