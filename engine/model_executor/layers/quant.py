"""int8 weights on CPU (issue 42): llama.cpp's Q8_0 blocks, packed for csrc/cpu/q8_gemm.cpp.

Q8_0: each run of 32 weights along a row's K is 32 int8 values q and one float16 scale d (w = d * q): 34 bytes per
32 weights, against bfloat16's 64. A decode step reads every weight once, so at a few rows the linears read about
half the bytes. The blocks come from a float checkpoint (`--quantization int8`: quantize_q8_0, llama.cpp's rounding)
or as they are from a GGUF Q8_0 file (engine/model_executor/gguf_native.py): the same numbers llama.cpp multiplies.

pack_q8 lays them out for the kernel (csrc/cpu/q8_gemm.cpp has the layout); quantize_linears gives each linear of a
model its packed copy and a forward that uses it (the float weight released), the small-row slot the compiled decode
step reads included. ref_q8_gemm is the pure-torch reference the kernel is tested against.
"""
from __future__ import annotations

import logging
import types
from typing import Callable, Optional

import torch
from torch import nn

from engine import ops

logger = logging.getLogger(__name__)

QK = 32  # weights per Q8_0 block (along K)
COLS = 16  # output columns per packed block (csrc/cpu/q8_gemm.cpp)
QUANTIZATIONS = ("int8",)  # --quantization choices
PACK_CHUNK_BYTES = 1 << 20  # int8 weights packed at a time (whole 16-row blocks): each temporary stays ~1 MiB


def q8_available() -> bool:
    """The compiled CPU kernels have an int8 path for this CPU (AVX2+FMA at least)."""
    return ops.q8_gemm_isa() > 0


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (llama.cpp's and gguf-py's rounding of Q8_0 weights): halves away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) as Q8_0 blocks: (q int8 [N, KB * 32], d float16 [N, KB]), K padded to a multiple
    of 32 with zeros. llama.cpp's quantize_row_q8_0: d = amax / 127 in float32, q = roundf(w / d) (w * (1 / d)),
    the scale stored rounded to float16."""
    n, k = weight.shape
    kb = -(-k // QK)
    w = nn.functional.pad(weight.float(), (0, kb * QK - k)).view(n, kb, QK)
    d = w.abs().amax(dim=-1) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = round_half_away(w * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.view(n, kb * QK), d.to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor, k: Optional[int] = None) -> torch.Tensor:
    """Q8_0 blocks back to float32 [N, K] (K: the unpadded width, default all of q's)."""
    n = q.shape[0]
    w = (q.float().view(n, -1, QK) * d.float().unsqueeze(-1)).view(n, -1)
    return w if k is None else w[:, :k]


def q8_numel(n: int, k: int) -> int:
    """Bytes of pack_q8's form of an [n, k] weight: 512 weight bytes and 16 float16 scales per 16 columns x 32 k."""
    return -(-n // COLS) * -(-k // QK) * COLS * (QK + 2)


def pack_q8(q: torch.Tensor, d: torch.Tensor, out: Optional[torch.Tensor] = None, row0: int = 0,
            total_rows: Optional[int] = None) -> torch.Tensor:
    """Q8_0 blocks (q int8 [N, KB * 32] or [N, KB, 32], views of a GGUF's blocks included; d float16 [N, KB]) in
    csrc/cpu/q8_gemm.cpp's layout, 1-D uint8: weights [N/16][KB][8][16][4] as q + 128, then scales [N/16][KB][16]
    float16; N padded to 16 with zeros. Into `out` (q8_numel(N, KB * 32) bytes) when given. A chunk of rows at a
    time, so the temporaries stay small; with row0 / total_rows these N rows are rows [row0, row0 + N) of a
    [total_rows, K] weight packed into `out` (row0 a multiple of 16; N too, unless they are the last rows)."""
    if q.dim() == 3:
        q = q.flatten(1) if q.is_contiguous() else q
    n = q.shape[0]
    kp = q.shape[1] * (q.shape[2] if q.dim() == 3 else 1)
    kb = kp // QK
    if q.dtype != torch.int8 or d.dtype != torch.float16 or kp % QK or tuple(d.shape) != (n, kb):
        raise ValueError(f"pack_q8: q int8 [N, KB * 32] and d float16 [N, KB], got {q.dtype} {tuple(q.shape)}, "
                         f"{d.dtype} {tuple(d.shape)}")
    total = n if total_rows is None else total_rows
    if row0 % COLS or row0 + n > total or (n % COLS and row0 + n != total):
        raise ValueError(f"pack_q8: rows [{row0}, {row0 + n}) of {total} do not start and end on {COLS}-row blocks")
    numel, nb = q8_numel(total, kp), -(-total // COLS)
    if out is None:
        out = torch.empty(numel, dtype=torch.uint8)
    elif out.shape != (numel,) or out.dtype != torch.uint8:
        raise ValueError(f"pack_q8: out must be 1-D uint8 of {numel} bytes, got {tuple(out.shape)} {out.dtype}")
    w_bytes = nb * kb * COLS * QK
    weights, scales = out[:w_bytes], out[w_bytes:].view(torch.float16)
    end = min(nb * COLS, row0 + -(-n // COLS) * COLS)  # these rows' blocks, padded
    chunk = max(COLS, PACK_CHUNK_BYTES // kp // COLS * COLS)  # rows; a down_proj's 1024 rows were 3 x 8 MiB
    for r0 in range(row0, end, chunk):
        r1 = min(end, r0 + chunk)
        qs, ds = q[r0 - row0:r1 - row0].reshape(-1, kp), d[r0 - row0:r1 - row0]
        if qs.shape[0] < r1 - r0:  # the last block's missing columns: zero weights, zero scales
            qs = nn.functional.pad(qs, (0, 0, 0, r1 - r0 - qs.shape[0]))
            ds = nn.functional.pad(ds, (0, 0, 0, r1 - r0 - ds.shape[0]))
        u = (qs.view(torch.uint8) ^ 0x80).view(-1, COLS, kb, QK // 4, 4)  # q + 128 (offset binary)
        weights[r0 * kp:r1 * kp] = u.permute(0, 2, 3, 1, 4).reshape(-1)
        scales[r0 * kb:r1 * kb] = ds.reshape(-1, COLS, kb).permute(0, 2, 1).reshape(-1)
    return out


def q8_rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int, dtype: torch.dtype = torch.float32
            ) -> torch.Tensor:
    """Rows `ids` of the [n, k] weight whose pack_q8 form is `packed`, dequantized: [*ids.shape, k] in dtype (an
    embedding read from a tied Q8_0 head, or a Q8_0 token embedding)."""
    nb, kb = -(-n // COLS), -(-k // QK)
    w_bytes = nb * kb * COLS * QK
    weights = packed[:w_bytes].view(nb, kb, QK // 4, COLS, 4)
    scales = packed[w_bytes:].view(torch.float16).view(nb, kb, COLS)
    blk, col = ids // COLS, ids % COLS
    q = (weights[blk, :, :, col] ^ 0x80).view(torch.int8)  # [*ids, kb, 8, 4]
    d = scales[blk, :, col]  # [*ids, kb]
    rows = q.float().flatten(-2) * d.float().unsqueeze(-1)
    return rows.flatten(-2)[..., :k].to(dtype)


Q8_0_BLOCK_BYTES = QK + 2  # a Q8_0 block as GGUF files hold it: float16 d, then 32 int8 q


def q8_file_rows(blocks: torch.Tensor, ids: torch.Tensor, k: int, dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """Rows `ids` of a Q8_0 tensor as the GGUF file lays it out (blocks: uint8 [n, KB * 34], each block float16 d
    then 32 int8 q; a read-only map of the file), dequantized as q8_rows does: [*ids.shape, k] in dtype. Only these
    rows' bytes are read."""
    kb = blocks.shape[1] // Q8_0_BLOCK_BYTES
    raw = blocks[ids.reshape(-1)].view(-1, kb, Q8_0_BLOCK_BYTES)  # the rows gathered (copied) out of the map
    q = raw[..., 2:].view(torch.int8)  # [m, kb, 32]
    d = raw[..., :2].view(torch.float16)  # [m, kb, 1]
    rows = q.float() * d.float()
    return rows.flatten(-2)[..., :k].to(dtype).view(*ids.shape, k)


LOW_STEPS = 254.0  # the low part's steps per step of the high one (csrc/cpu/q8_gemm.cpp kLowSteps)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] per 32-block in the VNNI path's two int8 parts: (xh, xl float [M, KB, 32] of integers, dx float32
    [M, KB]) with x ~ dx * (xh + xl / 254); dx = amax / 127, t = x * (1 / dx), xh = round-half-even(t),
    xl = round-half-even(254 * (t - xh)); 0 for a block of zeros."""
    m, k = x.shape
    kb = -(-k // QK)
    xb = nn.functional.pad(x.float(), (0, kb * QK - k)).view(m, kb, QK)
    dx = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(dx == 0, torch.zeros_like(dx), 1.0 / dx)
    t = xb * inv.unsqueeze(-1)
    xh = torch.round(t).clamp_(-127, 127)
    xl = torch.round((t - xh) * LOW_STEPS).clamp_(-127, 127)
    return xh, xl, dx


def ref_q8_gemm(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: Optional[torch.Tensor] = None,
                quantized_x: bool = False, weight_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float64 [M, N] reference of q8_gemm: x [M, K] against Q8_0 blocks (q [N, KB * 32], d [N, KB]).

    quantized_x: x split per 32-block into two int8 parts first (the VNNI path: exact integer block sums, each
    scaled by the float32 product d * dx); else x times the dequantized weight (the widening and panel paths),
    rounded to weight_dtype first (bfloat16: the panel path's bfloat16 panels)."""
    m, k = x.shape
    n = q.shape[0]
    if quantized_x:
        xh, xl, dx = quantize_activations(x)
        qb = q.double().view(n, -1, QK)
        sums = (torch.einsum("mjc,njc->mnj", xh.double(), qb)  # exact: |sum| < 2^19
                + torch.einsum("mjc,njc->mnj", xl.double(), qb) / LOW_STEPS)
        scale = (d.float().unsqueeze(0) * dx.unsqueeze(1)).double()  # [M, N, KB], rounded to float32 as the kernel
        out = (sums * scale).sum(-1)
    else:
        out = x.double() @ dequantize_q8_0(q, d, k).to(weight_dtype).double().T
    return out if bias is None else out + bias.double()


# ------------------------------------------------------------------ model


def _q8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] -> [..., out_features]
    if x.device.type != "cpu" or x.shape[-1] != self.in_features or x.dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(f"int8 linear ({self.in_features} -> {self.out_features}) got an input of shape "
                           f"{tuple(x.shape)}, {x.dtype}, on {x.device}: it serves CPU float32 / bfloat16 inputs "
                           f"[..., {self.in_features}]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, self.in_features) if len(lead) != 1 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = x2.new_empty(x2.shape[0], self.out_features)
    ops.q8_gemm(out, x2, self._small_weight, self.bias)
    return out if len(lead) == 1 else out.view(*lead, self.out_features)


def _q8_embedding_forward(self: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.num_embeddings):
        raise IndexError(f"token id out of range [0, {self.num_embeddings}) for an int8 embedding")
    return q8_rows(self._q8_weight, input_ids, self.num_embeddings, self.embedding_dim, self._q8_dtype)


def _q8_file_embedding_forward(self: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.num_embeddings):
        raise IndexError(f"token id out of range [0, {self.num_embeddings}) for an int8 embedding")
    rows = q8_file_rows(self._q8_file_blocks, input_ids, self.embedding_dim, self._q8_dtype)
    if self._q8_file_release is not None:
        self._q8_file_release()
    return rows


def attach_q8_linear(linear: nn.Linear, packed: torch.Tensor) -> None:
    """linear now multiplies with its pack_q8 weight (every row count), its float weight released. The packed copy
    sits where engine/model_executor/layers/cpu_linear.py keeps a small-row copy, so the compiled decode step reads it."""
    linear._small_weight = packed
    linear._small_max_rows = 1 << 62
    linear._packed_weight = None
    linear._q8 = True
    linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
    linear.forward = types.MethodType(_q8_forward, linear)


def attach_q8_embedding(emb: nn.Embedding, packed: torch.Tensor, dtype: torch.dtype) -> None:
    """emb gathers its rows from a pack_q8 weight [num_embeddings, embedding_dim], dequantized to dtype."""
    emb._q8_weight = packed
    emb._q8_dtype = dtype
    emb.weight = nn.Parameter(emb.weight.new_empty(0), requires_grad=False)
    emb.forward = types.MethodType(_q8_embedding_forward, emb)


def attach_q8_file_embedding(emb: nn.Embedding, blocks: torch.Tensor, dtype: torch.dtype,
                             release: Optional[Callable[[], None]] = None) -> None:
    """emb gathers its rows from a GGUF's Q8_0 token embedding as the file holds it (blocks: uint8
    [num_embeddings, embedding_dim / 32 * 34], a read-only map of the file: engine/model_executor/gguf_native.py),
    dequantized to dtype; release(), when given, is called after each gather (the map lets go of its pages)."""
    if tuple(blocks.shape) != (emb.num_embeddings, -(-emb.embedding_dim // QK) * Q8_0_BLOCK_BYTES):
        raise ValueError(f"a Q8_0 embedding of {emb.num_embeddings} x {emb.embedding_dim} needs blocks "
                         f"[{emb.num_embeddings}, {-(-emb.embedding_dim // QK) * Q8_0_BLOCK_BYTES}], got "
                         f"{tuple(blocks.shape)}")
    emb._q8_file_blocks, emb._q8_file_release = blocks, release
    emb._q8_dtype = dtype
    emb.weight = nn.Parameter(emb.weight.new_empty(0), requires_grad=False)
    emb.forward = types.MethodType(_q8_file_embedding_forward, emb)


@torch.no_grad()
def quantize_linears(model: nn.Module) -> int:
    """`--quantization int8` on a loaded float model: every CPU nn.Linear (the head included) gets Q8_0 weights
    (quantize_q8_0) in the kernel's layout, and its float weight is released as soon as its copy exists; a tied
    embedding then reads its rows from the head's copy, an untied one from its own Q8_0 copy. Returns how many
    linears were quantized."""
    if not q8_available():
        raise ValueError("--quantization int8 needs pagedserve's compiled CPU kernels with AVX2+FMA at least")
    from engine.model_executor.layers.cpu_linear import _trim_heap

    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
               and m.weight.numel() > 0]
    tied = {}
    for emb in model.modules():
        if type(emb) is nn.Embedding and emb.weight.numel() > 0:
            tied[emb.weight.untyped_storage().data_ptr()] = emb
    for linear in linears:
        w = linear.weight
        emb = tied.get(w.untyped_storage().data_ptr())
        q, d = quantize_q8_0(w.detach())
        packed = pack_q8(q, d)
        del q, d
        dtype = w.dtype
        attach_q8_linear(linear, packed)
        if emb is not None and tuple(emb.weight.shape) == (linear.out_features, linear.in_features):
            attach_q8_embedding(emb, packed, dtype)
        del w
        _trim_heap()
    for emb in set(tied.values()):  # an untied embedding: its own Q8_0 copy (llama.cpp's token_embd is Q8_0 too)
        if emb.weight.numel() > 0 and emb.max_norm is None:
            w = emb.weight.detach()
            attach_q8_embedding(emb, pack_q8(*quantize_q8_0(w)), w.dtype)
            del w
            _trim_heap()
    logger.info("quantized %d linear layers to int8 (Q8_0 blocks)", len(linears))
    return len(linears)
