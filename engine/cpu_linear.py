"""Prepacked oneDNN GEMMs for the nn.Linear layers of a model that runs on CPU.

F.linear on CPU repacks the weight matrix on every call; a weight reordered once into oneDNN's blocked
layout skips that. The product is the same float32 GEMM up to summation order (~1e-6 relative).
bfloat16 weights are packed where oneDNN can (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), with float32
accumulation; elsewhere (an AVX2-only CPU) they stay on F.linear. What this buys, measured, is in
docs/benchmarks.md ("Packed oneDNN linears").

Invariants: the packed copy replaces the original, so each weight is held once: pack_linears leaves an
empty tensor of the same dtype in its place (in_features/out_features kept). A weight shared with another
parameter, as a head tied to the embedding, is kept: the embedding still reads it. A packed linear serves
CPU inputs of its own dtype only (RuntimeError otherwise), of any leading shape.

Use (the loader, once the weights are loaded):

    pack_linears(model)   # every CPU nn.Linear of a packed dtype now multiplies with its packed copy
"""
from __future__ import annotations

import logging
import os
import types
from collections import Counter

import torch
from torch import nn

from engine.memory import find_malloc_trim

logger = logging.getLogger(__name__)

# PAGEDSERVE_PACKED_LINEAR=0 keeps F.linear (A/B comparisons, or a torch without oneDNN).
_ENV = "PAGEDSERVE_PACKED_LINEAR"


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


def bucket_rows(rows: int) -> int:
    """rows rounded up to a multiple of 2^(k-3) for rows in [2^k, 2^(k+1)); rows itself up to EXACT_ROWS."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] -> [..., out_features]
    packed = self._packed_weight  # [out_features, in_features], oneDNN's blocked layout
    if x.dtype != packed.dtype or x.device.type != "cpu" or x.shape[-1] != self.in_features:
        # No F.linear fallback: the weight it would need is released (pack_linears); oneDNN's own errors say little.
        raise RuntimeError(
            f"packed linear ({self.in_features} -> {self.out_features}, {packed.dtype}) got an input of shape "
            f"{tuple(x.shape)}, {x.dtype}, on {x.device}: a linear packed by pack_linears serves CPU "
            f"{packed.dtype} inputs [..., {self.in_features}] only"
        )
    lead = x.shape[:-1]
    if len(lead) != 1:  # the model's own calls are 2-D: skip the reshapes there (~2 us each, 120 calls a step)
        x = x.reshape(-1, self.in_features)  # [num_tokens, in_features]
    rows = x.shape[0]
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
    module._packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
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
