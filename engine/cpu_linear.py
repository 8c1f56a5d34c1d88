"""Prepacked oneDNN GEMMs for the nn.Linear layers of a model that runs on CPU.

F.linear on CPU repacks the weight matrix on every call; a weight reordered once into oneDNN's blocked
layout skips that. The product is the same float32 GEMM up to summation order (~1e-6 relative).
bfloat16 weights are packed where oneDNN can (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), with float32
accumulation; elsewhere (an AVX2-only CPU) they stay on F.linear. What this buys, measured, is in
docs/benchmarks.md ("Packed oneDNN linears").

Invariants: the packed copies replace the original: pack_linears leaves an
empty tensor of the same dtype in its place (in_features/out_features kept). A weight shared with another
parameter, as a head tied to the embedding, is kept: the embedding still reads it. A packed linear serves
CPU inputs of its own dtype only (RuntimeError otherwise), of any leading shape.

Small row counts (a decode step's few sequences) go to csrc/cpu/small_gemm.cpp instead: at 1 to SMALL_ROWS rows
a linear is a matrix-vector product bound by reading the weights once, and oneDNN's GEMM, built for many rows,
streamed them well under the memory's speed (docs/benchmarks.md, "Small-row linears"). That kernel reads its
own copy of each weight, packed here (pack_small_rows): float32 weights are then held twice (both packed forms).
bfloat16 weights on a CPU without AVX-512 BF16 are held once, in the small-row form only: that kernel serves
every row count there (_small_rows_everywhere). PAGEDSERVE_SMALL_ROW_LINEAR=0 leaves every row count to oneDNN
and makes no small-row copy.

Use (the loader, once the weights are loaded):

    pack_linears(model)   # every CPU nn.Linear of a packed dtype now multiplies with its packed copy
"""
from __future__ import annotations

import logging
import os
import sys
import types
from collections import Counter

import torch
from torch import nn

from engine import ops
from engine.memory import find_malloc_trim

logger = logging.getLogger(__name__)

# PAGEDSERVE_PACKED_LINEAR=0 keeps F.linear (A/B comparisons, or a torch without oneDNN).
_ENV = "PAGEDSERVE_PACKED_LINEAR"
_SMALL_ENV = "PAGEDSERVE_SMALL_ROW_LINEAR"

# Row counts up to this go to the small-row kernel (measured: benchmarks/small_gemm.py).
SMALL_ROWS = 16
SMALL_BLOCK = 16  # output columns per block of the small-row layout (csrc/cpu/small_gemm.cpp)


def packed_linear_available() -> bool:
    """oneDNN is built into this torch and its packed-linear ops are registered."""
    return (
        os.environ.get(_ENV, "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs on this CPU: float32 always, bfloat16 where oneDNN supports it."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


# oneDNN builds (and caches, LRU) one primitive per input shape. A server sees every row count from 1 to
# max_num_batched_tokens, so with exact shapes the cache churns and the process grows with each new one
# (docs/reliability.md). Row counts above
# EXACT_ROWS are padded up to one of 8 buckets per power of two (at most 12.5 % spare rows): about 70
# shapes per layer from 1 to 2048 rows.
EXACT_ROWS = 16


def small_rows_available() -> bool:
    """The compiled kernels have a small-row GEMM path for this CPU (AVX2+FMA at least), not switched off."""
    return os.environ.get(_SMALL_ENV, "1") != "0" and ops.small_gemm_isa() > 0


def _small_rows_everywhere(dtype: torch.dtype) -> bool:
    """bfloat16 without vdpbf16ps (this CPU has no AVX-512 BF16): oneDNN then widens bfloat16 itself and was
    slower than the small-row kernel at every row count, prefill included (docs/benchmarks.md), so that kernel
    serves them all and the oneDNN copy is never made."""
    return dtype == torch.bfloat16 and ops.small_gemm_isa() < ops.SMALL_GEMM_AVX512_BF16


def pack_small_rows(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] in csrc/cpu/small_gemm.cpp's streaming layout, 1-D, zero-padded: float32 [N/16][K][16],
    bfloat16 [N/16][K/2][16][2] (pairs of k per column: vdpbf16ps' operand)."""
    n, k = weight.shape
    n_pad = -n % SMALL_BLOCK
    if weight.dtype == torch.float32:
        w = nn.functional.pad(weight, (0, 0, 0, n_pad))
        return w.view(-1, SMALL_BLOCK, k).transpose(1, 2).contiguous().view(-1)
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"the small-row layout is for float32 and bfloat16 weights, got {weight.dtype}")
    w = nn.functional.pad(weight, (0, k % 2, 0, n_pad))
    return w.view(-1, SMALL_BLOCK, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)


def bucket_rows(rows: int) -> int:
    """rows rounded up to a multiple of 2^(k-3) for rows in [2^k, 2^(k+1)); rows itself up to EXACT_ROWS."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] -> [..., out_features]
    packed = self._packed_weight  # [out_features, in_features], oneDNN's blocked layout; None: small-row kernel only
    dtype = (packed if packed is not None else self._small_weight).dtype
    if x.dtype != dtype or x.device.type != "cpu" or x.shape[-1] != self.in_features:
        # No F.linear fallback: the weight it would need is released (pack_linears); oneDNN's own errors say little.
        raise RuntimeError(
            f"packed linear ({self.in_features} -> {self.out_features}, {dtype}) got an input of shape "
            f"{tuple(x.shape)}, {x.dtype}, on {x.device}: a linear packed by pack_linears serves CPU "
            f"{dtype} inputs [..., {self.in_features}] only"
        )
    lead = x.shape[:-1]
    if len(lead) != 1:  # the model's own calls are 2-D: skip the reshapes there (~2 us each, 120 calls a step)
        x = x.reshape(-1, self.in_features)  # [num_tokens, in_features]
    rows = x.shape[0]
    small = self._small_weight
    if small is not None and rows <= self._small_max_rows:
        out = ops.small_gemm(x.new_empty(rows, self.out_features), x if x.stride(-1) == 1 else x.contiguous(),
                             small, self.bias)
        return out if len(lead) == 1 else out.view(*lead, self.out_features)
    pad = bucket_rows(rows) - rows
    if pad:
        x = nn.functional.pad(x, (0, 0, 0, pad))  # zero rows at the end
    out = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [None], "")
    out = out[:rows] if pad else out  # [num_tokens, out_features]
    return out if len(lead) == 1 else out.view(*lead, self.out_features)


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Give every CPU nn.Linear of a packed dtype (packed_dtypes()) a packed weight and a forward that uses it.

    Returns how many linears were packed.

    Each packed linear's own weight is released (left as an empty tensor); one shared with another parameter
    or buffer of `model` (a tied head) is kept. Released weights cannot be reloaded: load into a fresh model.
    The packed copy of a kept one is a snapshot: a change to that weight needs another call.
    """
    if not packed_linear_available():
        return 0
    users = _storage_users(model)
    dtypes = packed_dtypes()
    linears = [m for m in model.modules() if type(m) is nn.Linear and _packable(m.weight, dtypes)]
    released = sum(_pack(m, users) for m in linears)
    if released:  # no reference to a released weight is left in this frame
        _trim_heap()
    logger.debug("packed %d linear layers for oneDNN, released %d original weights", len(linears), released)
    return len(linears)


def _packable(w: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    # numel 0: released by an earlier call, whose packed copy still serves.
    return w.device.type == "cpu" and w.dtype in dtypes and not w.is_meta and w.numel() > 0


def _pack(module: nn.Linear, users: Counter) -> bool:
    """Pack module's weight and switch its forward; True when the original weight was its own and is released."""
    w = module.weight
    module._small_weight = pack_small_rows(w.detach()) if small_rows_available() else None
    small_everywhere = module._small_weight is not None and _small_rows_everywhere(w.dtype)
    module._small_max_rows = sys.maxsize if small_everywhere else SMALL_ROWS
    module._packed_weight = None if small_everywhere else torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
    module.forward = types.MethodType(_packed_forward, module)
    if users[w.untyped_storage().data_ptr()] > 1:
        return False
    # Empty, same dtype and device: F.linear or a reload into it fails loudly instead of using stale values.
    module.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
    return True


def _storage_users(model: nn.Module) -> Counter:
    """How many parameters and buffers of `model` use each storage (by address): a weight is its own when 1."""
    tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
    tensors += [t for _, t in model.named_buffers(remove_duplicate=False)]
    return Counter(t.untyped_storage().data_ptr() for t in tensors if not t.is_meta and t.numel())


def _trim_heap() -> None:
    """Give the released weights' pages back to the OS.

    glibc serves blocks of a few MiB from its heap once the loader has freed larger ones (its mmap threshold
    rises up to 32 MiB), and free() returns heap pages only from the top: without a trim SmolLM2's RSS stayed
    at two copies in bfloat16 and lost under half the second one in float32.
    """
    trim = find_malloc_trim()
    if trim is not None:
        trim(0)
