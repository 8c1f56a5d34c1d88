"""Prepacked oneDNN GEMMs for the nn.Linear layers of a model that runs on CPU.

F.linear on CPU repacks the weight matrix on every call; a weight reordered once into oneDNN's blocked
layout skips that. The product is the same float32 GEMM up to summation order (~1e-6 relative).
bfloat16 weights are packed where oneDNN can (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), with float32
accumulation; on an AVX2-only CPU the small-row kernel below serves them alone. What this buys, measured, is in
docs/benchmarks.md ("Packed oneDNN linears").

Invariants: the packed copies replace the original: pack_linears leaves an
empty tensor of the same dtype in its place (in_features/out_features kept). A weight shared with another
parameter is kept, unless the other user is an nn.Embedding that can read the small-row copy (a tied head). A
packed linear serves CPU inputs of its own dtype only (RuntimeError otherwise), of any leading shape.

Small row counts (a decode step's few sequences) go to csrc/cpu/small_gemm.cpp instead: at 1 to SMALL_ROWS rows
a linear is a matrix-vector product bound by reading the weights once, and oneDNN's GEMM, built for many rows,
streamed them well under the memory's speed (docs/benchmarks.md, "Small-row linears"). That kernel reads its
own copy of each weight, packed here (pack_small_rows). That kernel also matches oneDNN on many rows (its
prefill tiles), so it serves every row count and no oneDNN copy is made (_small_rows_everywhere): float32 and
bfloat16 on every CPU with its AVX2+FMA path at least, except bfloat16 on a CPU with AMX (oneDNN's tile GEMM
there, not measured, keeps the rows above SMALL_ROWS, and the weights are held twice).
PAGEDSERVE_SMALL_ROW_LINEAR=0 leaves every row count to oneDNN and makes no small-row copy.

A head tied to the embedding (SmolLM2) is held once: the embedding's rows are gathered from the head's small-row
copy (_embed_from_packed_head), and both original weights are released.

Use (the loader, once the weights are loaded):

    pack_linears(model)   # every CPU nn.Linear of a packed dtype now multiplies with its packed copy
"""
from __future__ import annotations

import logging
import mmap
import os
import sys
import types
from collections import Counter
from typing import Optional

import torch
from torch import nn

from engine import ops
from engine.platform.memory import find_malloc_trim

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
    """The weight dtypes pack_linears packs on this CPU: float32 always; bfloat16 where oneDNN supports it, or
    where the small-row kernel serves it at every row count without oneDNN (an AVX2-only CPU, whose oneDNN has no
    bfloat16: F.linear there ran bfloat16 ~4x slower than float32)."""
    if _onednn_packs_bf16() or (small_rows_available() and _small_rows_everywhere(torch.bfloat16)):
        return torch.float32, torch.bfloat16
    return (torch.float32,)


def _onednn_packs_bf16() -> bool:
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bf16 is not None and bool(bf16())


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
    """The small-row kernel serves every row count, prefill included, and no oneDNN copy is made.

    Measured (docs/benchmarks.md, "Small-row linears", "An AVX2-only CPU's paths", "AVX-512 BF16"): bfloat16 on
    every path: without vdpbf16ps oneDNN widens bfloat16 itself and was 3-5x slower at every row count (on AVX2
    oneDNN has no bfloat16, and F.linear was 4x slower than the kernel); with vdpbf16ps (Zen 4) the kernel's tiles
    were 1.3-1.45x oneDNN's native bf16 GEMM at 1 to 32 rows and 1.00-1.02x from 128 to 2048, so oneDNN's copy
    (a second 256 MiB of weights) bought nothing; float32 on the AVX-512 path, whose prefill tiles run at oneDNN's
    rate from 128 to 2048 rows; float32 on the AVX2 path (its 6-row tiles 0.92-0.94x oneDNN's GEMM at 128-512
    rows, the served steps the same speed, a weight copy less). Not measured, so oneDNN keeps the many-row
    products: bfloat16 on a CPU with AMX, whose tile units oneDNN's GEMM uses and the kernel does not."""
    if ops.small_gemm_isa() < ops.SMALL_GEMM_AVX2:
        return False
    if dtype == torch.bfloat16:
        return not _cpu_has_amx()
    return dtype == torch.float32


def _cpu_has_amx() -> bool:
    return bool(getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", lambda: False)())


def small_rows_numel(weight: torch.Tensor) -> int:
    """Elements of W [N, K]'s pack_small_rows form."""
    n, k = weight.shape
    return -(-n // SMALL_BLOCK) * SMALL_BLOCK * (k if weight.dtype == torch.float32 else k + k % 2)


def pack_small_rows(weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W [N, K] in csrc/cpu/small_gemm.cpp's streaming layout, 1-D, zero-padded: float32 [N/16][K][16],
    bfloat16 [N/16][K/2][16][2] (pairs of k per column: vdpbf16ps' operand). Into `out` (1-D, W's dtype,
    small_rows_numel(W) elements) when given.

    Packed PACK_CHUNK_BLOCKS blocks at a time into the result: the temporaries stay a few MiB however large W is
    (whole, the LM head's would have held W three times at the load's peak)."""
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the small-row layout is for float32 and bfloat16 weights, got {weight.dtype}")
    numel, blocks = small_rows_numel(weight), -(-weight.shape[0] // SMALL_BLOCK)
    per_block = numel // blocks  # elements of one packed block
    if out is None:
        out = weight.new_empty(numel)
    elif out.shape != (numel,) or out.dtype != weight.dtype:
        raise ValueError(f"pack_small_rows: out must be 1-D {weight.dtype} of {numel} elements, "
                         f"got {tuple(out.shape)} {out.dtype}")
    for b0 in range(0, blocks, PACK_CHUNK_BLOCKS):
        b1 = min(blocks, b0 + PACK_CHUNK_BLOCKS)
        out[b0 * per_block:b1 * per_block] = _pack_blocks(weight[b0 * SMALL_BLOCK:b1 * SMALL_BLOCK])
    return out


PACK_CHUNK_BLOCKS = 64  # 1024 rows of W a chunk


def _pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    n_pad = -n % SMALL_BLOCK
    if weight.dtype == torch.float32:
        w = nn.functional.pad(weight, (0, 0, 0, n_pad))
        return w.view(-1, SMALL_BLOCK, k).transpose(1, 2).contiguous().view(-1)
    w = nn.functional.pad(weight, (0, k % 2, 0, n_pad))
    return w.view(-1, SMALL_BLOCK, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)


def forward_float32(linear: nn.Linear, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """linear(x).float() for x [rows, in_features]. A bfloat16 linear on the small-row kernel writes its bfloat16
    result widened to float32 directly (the same values): a head's [rows, vocab] logits are not written in
    bfloat16 and then copied (at 32 decode rows of SmolLM2, ~0.5 ms of a ~36 ms step on a Zen 4).
    `out` ([rows, out_features] float32, rows contiguous): where the small-row kernel writes the result, so that a
    caller reusing one buffer does not fault in fresh pages for a vocabulary-wide result every step; the result is
    the returned tensor either way."""
    small = getattr(linear, "_small_weight", None)
    if (small is not None and small.dtype in (torch.bfloat16, torch.float32) and x.dtype == small.dtype
            and (small.dtype == torch.bfloat16 or out is not None) and x.dim() == 2
            and x.device.type == "cpu" and x.shape[-1] == linear.in_features
            and x.shape[0] <= linear._small_max_rows):
        if out is None:
            out = torch.empty(x.shape[0], linear.out_features, dtype=torch.float32)
        return ops.small_gemm(out, x if x.stride(-1) == 1 else x.contiguous(), small, linear.bias)
    if (getattr(linear, "_q8", False) and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == "cpu" and x.shape[-1] == linear.in_features):  # an int8 head (engine/model_executor/layers/quant.py)
        if out is None:
            out = torch.empty(x.shape[0], linear.out_features, dtype=torch.float32)
        return ops.q8_gemm(out, x if x.stride(-1) == 1 else x.contiguous(), small, linear.bias)
    if (small is not None and small.dtype == torch.int8 and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == "cpu" and x.shape[-1] == linear.in_features):  # GGML block formats (formats.py)
        if out is None:
            out = torch.empty(x.shape[0], linear.out_features, dtype=torch.float32)
        return ops.kquant_gemm(out, x if x.stride(-1) == 1 else x.contiguous(), small, linear.bias)
    return linear(x).float()


def serves_head_stats(linear: nn.Linear, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    """head_argmax_lse serves this head on `rows` rows of x (dtype, device): its small-row kernel's float weight
    does (not an int8 head, nor one that oneDNN serves at this many rows)."""
    small = getattr(linear, "_small_weight", None)
    return (small is not None and not getattr(linear, "_q8", False) and small.dtype in (torch.bfloat16, torch.float32)
            and dtype == small.dtype and device.type == "cpu" and rows <= linear._small_max_rows)


def head_argmax_lse(linear: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A head's greedy stats without its logits (ops.small_gemm_argmax_lse), where serves_head_stats: per row of x,
    [rows, in_features], of forward_float32(linear, x): (argmax, max, logsumexp), the same argmax and max as the
    logits' (the same tiles write the same float32 values)."""
    return ops.small_gemm_argmax_lse(x if x.stride(-1) == 1 else x.contiguous(), linear._small_weight,
                                     linear.out_features, linear.bias)


def small_rows_weight(linear: nn.Module) -> Optional[tuple[torch.Tensor, int]]:
    """(the packed weight the small-row kernel reads for `linear`, the most rows it serves there), or None when it
    has none (not packed, oneDNN only, PAGEDSERVE_SMALL_ROW_LINEAR=0). engine/model_executor/layers/quant.py's int8 linears keep their
    packed weight in the same place, served at every row count."""
    small = getattr(linear, "_small_weight", None)
    return None if small is None else (small, linear._small_max_rows)


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

    Each packed linear's own weight is released (left as an empty tensor) as soon as its packed copy exists; one
    shared with another parameter or buffer of `model` is kept, unless that is an embedding which then reads the
    head's small-row copy (a tied head). Released weights cannot be reloaded: load into a fresh model.
    The packed copy of a kept one is a snapshot: a change to that weight needs another call.
    """
    if not packed_linear_available():
        return 0
    dtypes = packed_dtypes()
    linears = [m for m in model.modules() if type(m) is nn.Linear and _packable(m.weight, dtypes)]
    users = _storage_users(model)
    released = 0
    slots = _small_rows_arena(linears) if small_rows_available() else {}
    for m in linears:  # each original goes as soon as its copy exists: the peak holds one linear twice, not all
        _pack(m, slots.get(m))
        if _release(m, users):
            released += 1
            _trim_heap()  # free() keeps the pages in glibc's heap, where the next packed copy may not fit
    if _embed_from_packed_head(model, linears):  # a tied head's weight is now its own
        users = _storage_users(model)
        released += sum(_release(m, users) for m in linears)
    if released:  # no reference to a released weight is left in this frame
        _trim_heap()
    logger.debug("packed %d linear layers for oneDNN, released %d original weights", len(linears), released)
    return len(linears)


def _packable(w: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    # numel 0: released by an earlier call, whose packed copy still serves.
    return w.device.type == "cpu" and w.dtype in dtypes and not w.is_meta and w.numel() > 0


def _small_rows_arena(linears: list[nn.Linear]) -> dict[nn.Linear, torch.Tensor]:
    """Each linear's slot for its small-row copy, in one buffer on huge pages (huge_page_buffer), in the order
    of `linears` (the model's: a step reads them in that order), each slot 64-byte aligned.

    One stream over contiguous, huge-paged weights instead of ~120 separate allocations on 4 KiB pages: a one-stream
    decode step ~2 % shorter (in-process A/B on a Zen 4, bfloat16 11.94 -> 11.65 ms, float32 19.70 -> 19.48 ms;
    contiguous alone, on 4 KiB pages, about half of that). The buffer's pages are written as each linear is
    packed, so the load's peak memory is unchanged."""
    offsets, total = [], 0
    for m in linears:
        offsets.append(total)
        total += -(-small_rows_numel(m.weight) * m.weight.element_size() // 64) * 64
    arena = huge_page_buffer(total)
    return {m: arena[o : o + small_rows_numel(m.weight) * m.weight.element_size()].view(m.weight.dtype)
            for m, o in zip(linears, offsets)}


HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of nbytes, its start 2 MiB-aligned, on transparent huge pages where the kernel gives them.

    Anonymous private memory asked for with MADV_HUGEPAGE (Linux, THP "always" or "madvise"): a stream over it
    takes one TLB entry per 2 MiB instead of per 4 KiB. Its pages are touched, and counted in RSS, as they are
    written, as torch.empty's are. The tensor keeps the mapping alive; without MADV_HUGEPAGE it is plain memory."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, nbytes + HUGE_PAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to `mapping`
    offset = -raw.data_ptr() % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes:
        try:
            mapping.madvise(advice, offset, nbytes)
        except OSError:  # a kernel without THP: plain pages
            pass
    return raw[offset : offset + nbytes]


def _pack(module: nn.Linear, small_slot: Optional[torch.Tensor] = None) -> None:
    """Pack module's weight (small-row form, into small_slot when given; oneDNN's form; or both) and switch its
    forward to them."""
    w = module.weight
    module._small_weight = pack_small_rows(w.detach(), small_slot) if small_rows_available() else None
    small_everywhere = module._small_weight is not None and _small_rows_everywhere(w.dtype)
    module._small_max_rows = sys.maxsize if small_everywhere else SMALL_ROWS
    module._packed_weight = None if small_everywhere else torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
    module.forward = types.MethodType(_packed_forward, module)


def _release(module: nn.Linear, users: Counter) -> bool:
    """Drop a packed linear's original weight unless another parameter still uses it; True when dropped."""
    w = module.weight
    if w.numel() == 0 or users[w.untyped_storage().data_ptr()] > 1:
        return False
    # Empty, same dtype and device: F.linear or a reload into it fails loudly instead of using stale values.
    module.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
    return True


def _embed_from_packed_head(model: nn.Module, linears: list[nn.Linear]) -> int:
    """Each plain nn.Embedding whose weight is a packed linear's (a tied head) gathers its rows from that linear's
    small-row copy, and lets go of the weight: the vocabulary is then held once, not twice or three times.
    Returns how many embeddings did."""
    done = 0
    heads = {m.weight.untyped_storage().data_ptr(): m for m in linears if m._small_weight is not None}
    for emb in model.modules():
        if type(emb) is not nn.Embedding or emb.max_norm is not None or emb.weight.numel() == 0:
            continue
        head = heads.get(emb.weight.untyped_storage().data_ptr())
        if head is None or tuple(emb.weight.shape) != (head.out_features, head.in_features):
            continue
        emb._small_weight = head._small_weight
        emb.forward = types.MethodType(_embedding_forward, emb)
        emb.weight = nn.Parameter(emb.weight.new_empty(0), requires_grad=False)
        done += 1
    return done


def small_rows_of(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Rows `ids` of the [n, k] weight whose pack_small_rows form is `packed`: [*ids.shape, k], a copy."""
    if packed.dtype == torch.float32:
        blocks = packed.view(-1, k, SMALL_BLOCK)  # [N/16, K, 16]
        rows = blocks[ids // SMALL_BLOCK, :, ids % SMALL_BLOCK]
    else:
        blocks = packed.view(-1, (k + 1) // 2, SMALL_BLOCK, 2)  # [N/16, K/2, 16, 2]
        rows = blocks[ids // SMALL_BLOCK, :, ids % SMALL_BLOCK].flatten(-2)[..., :k]
    return rows


def _embedding_forward(self: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.num_embeddings):
        raise IndexError(f"token id out of range [0, {self.num_embeddings}) for an embedding read from its tied head")
    return small_rows_of(self._small_weight, input_ids, self.num_embeddings, self.embedding_dim)


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
