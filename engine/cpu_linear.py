"""Prepacked oneDNN GEMMs for the nn.Linear layers of a model that runs on CPU.

F.linear on CPU calls MKL's sgemm, which repacks the whole weight matrix on
every call; on a decode step (a few dozen rows against a 576 x 49152 head) that
packing costs more than the multiply, and MKL does not use AVX-512 on AMD CPUs.
oneDNN's linear with a weight reordered once into its blocked layout skips both:
about 3x on the LM head and 1.3-1.5x on the other layers of SmolLM2 at batch 32
(docs/benchmarks.md). The result is the same float32 product up to summation
order (~1e-6 relative), like any other GEMM library.

bfloat16 weights are packed too: oneDNN then runs AVX-512 BF16 dot products
(float32 accumulation) where the CPU has them, 1.6-1.9x F.linear on the LM head
and the same output bits as F.linear in our checks.

Use (the model runner, once the weights are loaded):

    pack_linears(model)   # every CPU float32/bfloat16 nn.Linear now multiplies with its packed copy
"""
from __future__ import annotations

import logging
import os
import types

import torch
from torch import nn

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


_PACKED_DTYPES = (torch.float32, torch.bfloat16)


# oneDNN builds (and caches, LRU) one primitive per input shape. A server sees every row count from 1 to
# max_num_batched_tokens, so with exact shapes the cache churns and the process grows with each new one
# (an LLM.generate loop with recompute preemptions: +18-22 MiB per round of 24 requests). Row counts above
# EXACT_ROWS are padded up to one of 8 buckets per power of two (at most 12.5 % spare rows): about 70
# shapes per layer from 1 to 2048 rows.
EXACT_ROWS = 16


def bucket_rows(rows: int) -> int:
    """rows rounded up to a multiple of 2^(k-3) for rows in [2^k, 2^(k+1)); rows itself up to EXACT_ROWS."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in_features]
    if x.dim() != 2 or x.dtype != self.weight.dtype or x.device.type != "cpu":
        return nn.functional.linear(x, self.weight, self.bias)
    rows = x.shape[0]
    pad = bucket_rows(rows) - rows
    if pad:
        x = nn.functional.pad(x, (0, 0, 0, pad))  # zero rows at the end
    out = torch.ops.mkldnn._linear_pointwise(x, self._packed_weight, self.bias, "none", [None], "")
    return out[:rows] if pad else out


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Give every float32/bfloat16 CPU nn.Linear of `model` a packed weight and a forward that uses it; returns how many.

    The packed copy is a snapshot: weights changed afterwards (a reload) need another call.
    """
    if not packed_linear_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype not in _PACKED_DTYPES or w.is_meta:
            continue
        module._packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        module.forward = types.MethodType(_packed_forward, module)
        count += 1
    logger.debug("packed %d linear layers for oneDNN", count)
    return count
