"""The weight formats a CPU linear serves natively: llama.cpp's GGML block types, one registry (issue 53).

A GGUF tensor's row is a run of blocks along K; each block holds integer codes q and scales. Every format here is,
per block, w = D * sc_j * q - M * mn_j: one float16 scale D and offset M a block ("super-block" for the K-quants),
and, for the K-quants, small integer scales sc_j and offsets mn_j per sub-block j of 32 (Q6_K: 16) weights:

  Q4_0  32 w, 18 B: d, 16 nibbles          w = d (q - 8)          D = d, M = 8 d
  Q4_1  32 w, 20 B: d, m, 16 nibbles        w = d q + m            D = d, M = -m
  Q5_0  32 w, 22 B: d, 32 high bits, nibbles w = d (q - 16)        D = d, M = 16 d
  Q5_1  32 w, 24 B: d, m, high bits, nibbles w = d q + m           D = d, M = -m
  Q4_K 256 w, 144 B: d, dmin, 6-bit scales and mins of 8 x 32, nibbles      w = d sc q - dmin mn
  Q5_K 256 w, 176 B: as Q4_K plus a high bit per weight
  Q6_K 256 w, 210 B: 4 + 2 bits a weight, int8 scales of 16 x 16, d          w = d sc (q - 32)
  Q8_0  32 w, 34 B: d, 32 int8              w = d q                (engine/model_executor/layers/quant.py)

components() unpacks a format's raw rows to (q, D, M, sc, mn); dequantize() is the float reference of llama.cpp's
dequantize_row_* (the tests check it against gguf-py's); csrc/cpu/kquant_gemm.cpp multiplies the blocks packed by
pack_kquant (the layout is described there) with activations quantized to int8. attach_quantized_linear gives an
nn.Linear its parts (a fused qkv may be Q4_K | Q4_K | Q6_K) and a forward over them; format_of says what it holds.
"""
from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from engine import ops
from engine.model_executor.layers import quant

logger = logging.getLogger(__name__)

COLS = 16  # output columns per packed block (csrc/cpu/kquant_gemm.cpp)
PACK_CHUNK_COLS = 512  # rows of W packed at a time: the temporaries stay a few MiB


Components = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]


@dataclass(frozen=True)
class WeightFormat:
    """One GGML block type: its geometry, its unpacking, and the kernel's code for it."""

    name: str  # GGML type name
    ggml_type: int  # gguf's GGMLQuantizationType value
    block_weights: int  # weights per block along K (32, or 256: a K-quant's super-block)
    block_bytes: int  # bytes of one block in a GGUF file
    bits: int  # bits of a code q (8: Q8_0's signed int8)
    sub_weights: int  # weights per sub-scale (0: none)
    unpack: Callable[[torch.Tensor], Components]  # raw blocks uint8 [N, KB, block_bytes] -> components

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of K weights (K a multiple of block_weights)."""
        if k % self.block_weights:
            raise ValueError(f"{self.name}: a row of {k} weights is not whole blocks of {self.block_weights}")
        return k // self.block_weights * self.block_bytes

    def components(self, raw: torch.Tensor) -> Components:
        """raw uint8 [N, row_bytes] -> (q uint8 [N, K] (Q8_0: int8), D float32 [N, KB], M float32 [N, KB],
        sc int8 [N, K / sub] or None, mn int8 [N, K / sub] or None): w = D * sc * q - M * mn per block."""
        n = raw.shape[0]
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % self.block_bytes:
            raise ValueError(f"{self.name}: raw rows are uint8 [N, KB * {self.block_bytes}], got {raw.dtype} "
                             f"{tuple(raw.shape)}")
        return self.unpack(raw.contiguous().view(n, -1, self.block_bytes))

    def dequantize(self, raw: torch.Tensor) -> torch.Tensor:
        """raw uint8 [N, row_bytes] -> float32 [N, K]: llama.cpp's dequantize_row_<type>, in its float32 order."""
        return _DEQUANT[self.name](self, raw)

    def native(self) -> bool:
        """This CPU's compiled kernels multiply this format directly."""
        if self.name == "Q8_0":
            return quant.q8_available()
        return ops.kquant_gemm_isa() > 0

    def packed_bytes(self, n: int, k: int) -> int:
        """Bytes of pack_kquant's form of an [n, k] weight (not Q8_0's: quant.q8_numel)."""
        return -(-n // COLS) * (k // self.block_weights) * _packed_block_bytes(self)


def _f16(b: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> float32 [...]
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [N, KB, 16] -> [N, KB, 32]: low nibbles, then high
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:  # [N, KB, 4] little-endian 32 bits -> [N, KB, 32] 0/1
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q4_0(b):
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:18]).flatten(1), d, 8 * d, None, None


def _q4_1(b):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return _nibbles(b[..., 4:20]).flatten(1), d, -m, None, None


def _q5_0(b):
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)
    return q.flatten(1), d, 16 * d, None, None


def _q5_1(b):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
    return q.flatten(1), d, -m, None, None


def _kscales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> (sc, mn) uint8 [N, KB, 8] (llama.cpp get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_low(qs: torch.Tensor) -> torch.Tensor:  # [N, KB, 128] -> [N, KB, 256]: per 64 weights, 32 low then 32 high
    n, kb = qs.shape[:2]
    q = qs.view(n, kb, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    return (q & 15).view(n, kb, 256)


def _q4_k(b):
    n = b.shape[0]
    sc, mn = _kscales(b[..., 4:16])
    return (_q4_low(b[..., 16:144]).view(n, -1), _f16(b[..., 0:2]), _f16(b[..., 2:4]),
            sc.view(n, -1).view(torch.int8), mn.view(n, -1).view(torch.int8))


def _q5_k(b):
    n, kb = b.shape[:2]
    sc, mn = _kscales(b[..., 4:16])
    qh = b[..., 16:48]  # bit j of byte l: weight 32 j + l
    high = (qh.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # [N, KB, 8, 32]
    q = _q4_low(b[..., 48:176]) | (high.view(n, kb, 256) << 4)
    return (q.view(n, -1), _f16(b[..., 0:2]), _f16(b[..., 2:4]), sc.view(n, -1).view(torch.int8),
            mn.view(n, -1).view(torch.int8))


def _q6_k(b):
    n, kb = b.shape[:2]
    ql = b[..., 0:128].reshape(n, kb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    qh = b[..., 128:192].reshape(n, kb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    q = (ql & 15).view(n, kb, 256) | ((qh & 3).view(n, kb, 256) << 4)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    d = _f16(b[..., 208:210])
    return q.view(n, -1), d, 32 * d, sc, sc


def _q8_0(b):
    d = _f16(b[..., 0:2])
    return b[..., 2:34].contiguous().view(torch.int8).reshape(b.shape[0], -1), d, torch.zeros_like(d), None, None


def _per_block(v: torch.Tensor, width: int) -> torch.Tensor:  # [N, B] -> [N, B * width], each value repeated
    return v.repeat_interleave(width, dim=1)


def _dq_offset(fmt: WeightFormat, raw: torch.Tensor) -> torch.Tensor:  # Q4_0 / Q5_0: d * (q - offset)
    q, d, _, _, _ = fmt.components(raw)
    offset = 8 if fmt.bits == 4 else 16
    return _per_block(d, 32) * (q.float() - offset)


def _dq_min(fmt: WeightFormat, raw: torch.Tensor) -> torch.Tensor:  # Q4_1 / Q5_1: d * q + m
    q, d, neg_m, _, _ = fmt.components(raw)
    return _per_block(d, 32) * q.float() + _per_block(-neg_m, 32)


def _dq_k(fmt: WeightFormat, raw: torch.Tensor) -> torch.Tensor:  # Q4_K / Q5_K: (d * sc) q - dmin * mn
    q, d, dmin, sc, mn = fmt.components(raw)
    scale = _per_block(d, 8) * sc.float()
    offset = _per_block(dmin, 8) * mn.float()
    return _per_block(scale, 32) * q.float() - _per_block(offset, 32)


def _dq_q6_k(fmt: WeightFormat, raw: torch.Tensor) -> torch.Tensor:  # (d * sc) (q - 32)
    q, d, _, sc, _ = fmt.components(raw)
    return _per_block(_per_block(d, 16) * sc.float(), 16) * (q.float() - 32)


def _dq_q8_0(fmt: WeightFormat, raw: torch.Tensor) -> torch.Tensor:
    q, d, _, _, _ = fmt.components(raw)
    return _per_block(d, 32) * q.float()


_DEQUANT = {"Q4_0": _dq_offset, "Q5_0": _dq_offset, "Q4_1": _dq_min, "Q5_1": _dq_min, "Q4_K": _dq_k,
            "Q5_K": _dq_k, "Q6_K": _dq_q6_k, "Q8_0": _dq_q8_0}

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("Q4_0", 2, 32, 18, 4, 0, _q4_0),
    WeightFormat("Q4_1", 3, 32, 20, 4, 0, _q4_1),
    WeightFormat("Q5_0", 6, 32, 22, 5, 0, _q5_0),
    WeightFormat("Q5_1", 7, 32, 24, 5, 0, _q5_1),
    WeightFormat("Q8_0", 8, 32, 34, 8, 0, _q8_0),
    WeightFormat("Q4_K", 12, 256, 144, 4, 32, _q4_k),
    WeightFormat("Q5_K", 13, 256, 176, 5, 32, _q5_k),
    WeightFormat("Q6_K", 14, 256, 210, 6, 16, _q6_k),
)}
_BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}


def get_format(name) -> Optional[WeightFormat]:
    """The registry's format for a GGML type name ("Q4_K") or its integer type; None for a type without kernels
    (the caller dequantizes it, with a warning naming the type)."""
    if isinstance(name, int) or hasattr(name, "value"):
        return _BY_TYPE.get(int(getattr(name, "value", name)))
    return FORMATS.get(str(name).upper())


# ------------------------------------------------------------------ the kernel's packed layout (kquant_gemm.cpp)

# Format codes of the packed blob's header (csrc/cpu/kquant_gemm.cpp kFmt*): the GGML type numbers.
BLOB_MAGIC = 0x4B51504B  # "KPQK"
HEADER_BYTES = 64  # int64 [8]: magic, parts, N, K, 0...
PART_BYTES = 32  # int64 [4] per part: ggml type, rows, offset, bytes


def _stores_m(fmt: WeightFormat) -> bool:  # M is not a fixed multiple of D (Q4_1, Q5_1, Q4_K, Q5_K)
    return fmt.name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")


def _packed_block_bytes(fmt: WeightFormat) -> int:
    """Bytes of one (16 columns, one block along K) tile of pack_kquant."""
    j32 = fmt.block_weights // 32
    hi = {4: 0, 5: 64, 6: 128}[fmt.bits]
    subs = fmt.block_weights // fmt.sub_weights if fmt.sub_weights else 0
    mins = subs if fmt.name in ("Q4_K", "Q5_K") else 0
    return j32 * (256 + hi) + 2 * COLS + (2 * COLS if _stores_m(fmt) else 0) + (subs + mins) * COLS


PACK_CHUNK_BYTES = 8 << 20  # raw bytes the compiled packers take at a time: a lazily read part holds only these


def row_chunks(raw) -> list[tuple[int, int]]:
    """Row ranges of about PACK_CHUNK_BYTES that start on a 16-column block (the last one ends at the last row)."""
    n, row_bytes = raw.shape
    step = max(COLS, PACK_CHUNK_BYTES // max(1, row_bytes) // COLS * COLS)
    return [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]


def rows_tensor(raw) -> torch.Tensor:
    """A part's raw rows as a tensor: raw itself, or all of a lazily read part's rows (gguf_file.FileRows)."""
    return raw if isinstance(raw, torch.Tensor) else raw[:]


def pack_kquant(fmt: WeightFormat, raw: torch.Tensor, out: Optional[torch.Tensor] = None, compiled: bool = True
                ) -> torch.Tensor:
    """raw uint8 [N, row_bytes] of fmt (not Q8_0) in csrc/cpu/kquant_gemm.cpp's layout, 1-D uint8 of
    fmt.packed_bytes(N, K); N padded to 16 columns with zeros. csrc/cpu/kquant_pack.cpp writes it where the compiled
    kernels are, unless compiled=False: this torch form (the reference), PACK_CHUNK_COLS rows at a time."""
    if fmt.name == "Q8_0" or fmt.bits > 6:
        raise ValueError("pack_kquant: Q8_0 is packed by engine/model_executor/layers/quant.py pack_q8")
    n = raw.shape[0]
    k = raw.shape[1] // fmt.block_bytes * fmt.block_weights
    total = fmt.packed_bytes(n, k)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8)
    if compiled and all(ops.kquant_pack(raw[r0:r1], fmt.ggml_type, out, r0, n) for r0, r1 in row_chunks(raw)):
        return out
    raw = rows_tensor(raw)
    per_cols = total // -(-n // COLS)  # bytes per 16 columns
    for r0 in range(0, n, PACK_CHUNK_COLS):
        r1 = min(n, r0 + PACK_CHUNK_COLS)
        out[r0 // COLS * per_cols:-(-r1 // COLS) * per_cols] = _pack_rows(fmt, raw[r0:r1], k)
    return out


def _pack_rows(fmt: WeightFormat, raw: torch.Tensor, k: int) -> torch.Tensor:
    q, d, m, sc, mn = fmt.components(raw)
    pad = -raw.shape[0] % COLS
    if pad:
        q, d, m = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, d, m))
        sc, mn = (None if t is None else nn.functional.pad(t, (0, 0, 0, pad)) for t in (sc, mn))
    nb, sb = q.shape[0] // COLS, k // fmt.block_weights  # column blocks, super-blocks
    j32 = fmt.block_weights // 32
    # codes [nb, sb, j32, 8 groups of 4 k, 16 columns, 4 k]
    qq = q.view(nb, COLS, sb, j32, 8, 4).permute(0, 2, 3, 4, 1, 5)
    low = qq & 15
    parts = [(low[:, :, :, :4] | (low[:, :, :, 4:] << 4)).reshape(nb, sb, -1)]  # group g low, g + 4 high
    if fmt.bits == 5:  # bit g of a byte: group g's fifth bit
        hb = (qq >> 4) & 1
        parts.append(sum(hb[:, :, :, g] << g for g in range(8)).reshape(nb, sb, -1))
    elif fmt.bits == 6:  # line h, bits 2i..2i+1: group 4h + i's top two bits
        hb = (qq >> 4) & 3
        parts.append(torch.stack([sum(hb[:, :, :, 4 * h + i] << (2 * i) for i in range(4)) for h in range(2)],
                                 dim=3).reshape(nb, sb, -1))

    def per_col(v: torch.Tensor) -> torch.Tensor:  # [Np, sb * s] -> [nb, sb, s * 16] bytes
        s = v.shape[1] // sb
        return v.view(nb, COLS, sb, s).permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(nb, sb, -1)

    def pairs(v: torch.Tensor) -> torch.Tensor:  # int8 [Np, sb * subs] -> [nb, sb, subs / 2 * 16 * 2]
        return v.view(nb, COLS, sb, -1, 2).permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8).reshape(nb, sb, -1)

    parts.append(per_col(d.half()))
    if _stores_m(fmt):
        parts.append(per_col(m.half()))
    if sc is not None:  # sub-blocks 2i and 2i + 1 of a column side by side: one int16 pair a 32-bit lane
        parts.append(pairs(sc))
        if fmt.name in ("Q4_K", "Q5_K"):
            parts.append(pairs(mn))
    return torch.cat(parts, dim=-1).reshape(-1)


def pack_q8_parts(parts: list[tuple[WeightFormat, torch.Tensor]], out: Optional[torch.Tensor] = None,
                  compiled: bool = True) -> torch.Tensor:
    """Q8_0 parts (raw uint8 [n_i, row_bytes]) of one weight, rows in order, in quant.pack_q8's layout: uint8
    q8_numel(sum n_i, K), into `out` when given. csrc/cpu/kquant_pack.cpp where the compiled kernels are, unless
    compiled=False (components() into pack_q8, the reference)."""
    n = sum(raw.shape[0] for _, raw in parts)
    fmt0, raw0 = parts[0]
    k = raw0.shape[1] // fmt0.block_bytes * fmt0.block_weights
    if out is None:
        out = torch.empty(quant.q8_numel(n, k), dtype=torch.uint8)
    if compiled:
        if any(raw.shape[0] % COLS for _, raw in parts[:-1]):  # a part ends inside a column block
            parts = [(fmt0, torch.cat([raw for _, raw in parts]))]
        row0 = 0
        for fmt, raw in parts:
            if not all(ops.kquant_pack(raw[r0:r1], fmt.ggml_type, out, row0 + r0, n) for r0, r1 in row_chunks(raw)):
                break
            row0 += raw.shape[0]
        else:
            return out
    q, d = zip(*[fmt.components(rows_tensor(raw))[:2] for fmt, raw in parts])
    return quant.pack_q8(torch.cat(q), torch.cat(d).half(), out)


def pack_parts(parts: list[tuple[WeightFormat, torch.Tensor]], compiled: bool = True) -> torch.Tensor:
    """A linear's parts (format, raw rows) as one int8 blob csrc/cpu/kquant_gemm.cpp multiplies: a header, then each
    part packed (pack_kquant, or pack_q8_parts for Q8_0), 64-byte aligned; compiled as pack_kquant."""
    k = None
    sizes = []
    for fmt, raw in parts:
        kk = raw.shape[1] // fmt.block_bytes * fmt.block_weights
        if k is not None and kk != k:
            raise ValueError(f"pack_parts: parts of {k} and {kk} input features")
        k = kk
        n = raw.shape[0]
        sizes.append(quant.q8_numel(n, k) if fmt.name == "Q8_0" else fmt.packed_bytes(n, k))
    head = -(-(HEADER_BYTES + PART_BYTES * len(parts)) // 64) * 64
    offsets, total = [], head
    for s in sizes:
        offsets.append(total)
        total += -(-s // 64) * 64
    blob = torch.zeros(total, dtype=torch.uint8)
    header = [BLOB_MAGIC, len(parts), sum(raw.shape[0] for _, raw in parts), k, 0, 0, 0, 0]
    for (fmt, raw), off, s in zip(parts, offsets, sizes):
        header += [fmt.ggml_type, raw.shape[0], off, s]
        dst = blob[off:off + s]
        if fmt.name == "Q8_0":
            pack_q8_parts([(fmt, raw)], dst, compiled)
        else:
            pack_kquant(fmt, raw, dst, compiled)
    blob[:8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    return blob.view(torch.int8)


# ------------------------------------------------------------------ linears


def _parts_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] -> [..., out]
    if x.device.type != "cpu" or x.shape[-1] != self.in_features or x.dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(f"quantized linear ({self.in_features} -> {self.out_features}) got an input of shape "
                           f"{tuple(x.shape)}, {x.dtype}, on {x.device}: it serves CPU float32 / bfloat16 inputs")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, self.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = x2.new_empty(x2.shape[0], self.out_features)
    if self._small_weight is not None:
        ops.kquant_gemm(out, x2, self._small_weight, self.bias)
    else:  # no kernel on this CPU / backend: dequantize and multiply (slow)
        w = torch.cat([fmt.dequantize(raw) for fmt, raw in self._quant_raw]).to(x2.dtype)
        out = nn.functional.linear(x2, w, self.bias)
    return out.view(*lead, self.out_features)


def attach_quantized_linear(linear: nn.Linear, parts: list[tuple[WeightFormat, torch.Tensor]]) -> None:
    """linear's output rows are the parts' rows in order (qkv = q | k | v, gate_up = gate | up), each part a format
    and its raw file rows (uint8 [n_i, row_bytes]). All Q8_0: quant's int8 path (uint8 pack_q8); else one int8 blob
    of the parts (pack_parts) that csrc/cpu/kquant_gemm.cpp multiplies, in eager forward and in the compiled decode
    step (cpu_linear.small_rows_weight). The float weight is released."""
    n = sum(raw.shape[0] for _, raw in parts)
    if n != linear.out_features:
        raise ValueError(f"attach_quantized_linear: parts of {n} rows for {linear.out_features} outputs")
    for fmt, raw in parts:
        if raw.shape[1] != fmt.row_bytes(linear.in_features):
            raise ValueError(f"attach_quantized_linear: a {fmt.name} part of {linear.in_features} features has "
                             f"{fmt.row_bytes(linear.in_features)} bytes a row, got {raw.shape[1]}")
    linear._quant_formats = [(fmt, raw.shape[0]) for fmt, raw in parts]
    if all(fmt.name == "Q8_0" for fmt, _ in parts) and quant.q8_available():
        quant.attach_q8_linear(linear, pack_q8_parts(parts))
        return
    native = all(fmt.native() for fmt, _ in parts)
    linear._small_weight = pack_parts(parts) if native else None
    linear._small_max_rows = 1 << 62
    linear._packed_weight = None
    linear._quant_raw = None if native else [(fmt, rows_tensor(raw).contiguous()) for fmt, raw in parts]
    if not native:
        logger.warning("no compiled kernel for %s here: a %d x %d linear dequantizes at every call",
                       "/".join(f.name for f, _ in parts), linear.out_features, linear.in_features)
    linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
    linear.forward = types.MethodType(_parts_forward, linear)


def format_of(linear: nn.Module) -> Optional[list[tuple[WeightFormat, int]]]:
    """The formats of a linear's parts, in output order, with their rows: [(Q4_K, 2048), (Q6_K, 512)]; None for a
    float linear. An int8 linear quantized at load (quant.quantize_linears) is one Q8_0 part."""
    parts = getattr(linear, "_quant_formats", None)
    if parts is not None:
        return list(parts)
    if getattr(linear, "_q8", False):
        return [(FORMATS["Q8_0"], linear.out_features)]
    return None


# ------------------------------------------------------------------ references (tests, benchmarks)

# Where each format keeps its float16 scales (random bytes there could be inf / NaN).
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}


def random_raw(fmt: WeightFormat, n: int, k: int, seed: int = 0, scale: float = 0.01) -> torch.Tensor:
    """n rows of k weights of fmt with random codes and sub-scales, float16 fields ~ N(0, scale): uint8
    [n, row_bytes] (tests and benchmarks)."""
    gen = torch.Generator().manual_seed(seed)
    kb = k // fmt.block_weights
    raw = torch.randint(0, 256, (n, kb, fmt.block_bytes), dtype=torch.uint8, generator=gen)
    for off in F16_FIELDS[fmt.name]:
        vals = (torch.randn(n, kb, generator=gen) * scale).half()
        raw[..., off:off + 2] = vals.view(torch.uint8).view(n, kb, 2)
    return raw.view(n, -1)


def quantize_activations(x: torch.Tensor, s: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """x [M, K] per block of s in the kernel's two int8 parts: [(xh, dx), (xl, dx / 254)], xq float [M, K] of integers
    in [-127, 127] and its scale float32 [M, K / s]; dx = amax / 127, t = x * (1 / dx), xh = round-half-even(t),
    xl = round-half-even(254 (t - xh)), 0 for a block of zeros; x = dx xh + (dx / 254) xl to 1 / 64516 of amax."""
    m, k = x.shape
    xb = x.float().view(m, k // s, s)
    dx = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(dx == 0, torch.zeros_like(dx), 1.0 / dx)
    t = xb * inv.unsqueeze(-1)
    xh = torch.round(t).clamp_(-127, 127)
    xl = torch.round((t - xh) * 254.0).clamp_(-127, 127)
    return [(xh.view(m, k), dx), (xl.view(m, k), dx / 254.0)]


def ref_kquant_gemm(x: torch.Tensor, fmt: WeightFormat, raw: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    x_block: Optional[int] = None) -> torch.Tensor:
    """float64 [M, N] reference of kquant_gemm's integer paths for one part: x in two int8 parts per x_block
    (quantize_activations; fmt's block by default, 32 where kquant_gemm scales x per 32: the x16 panels, and every
    path from 16 rows), the exact integer sums per unit (a sub-block, or an x block where that is shorter) sum q xq
    and sum xq, scaled by dx * (D sc S1 - M mn S2), the units and the parts' products summed."""
    q, d, mvals, sc, mn = fmt.components(raw)
    n, k = q.shape
    s = fmt.block_weights
    xb = x_block or s
    sub = fmt.sub_weights or s
    g = min(sub, xb)  # one sub-scale and one x scale a unit
    m = x.shape[0]
    qs = q.double().view(n, k // g, g)
    scv = torch.ones(n, k // sub, dtype=torch.float64) if sc is None else sc.double()
    mnv = torch.ones(n, k // sub, dtype=torch.float64) if mn is None else mn.double()
    scale = (d.double().repeat_interleave(s // g, 1) * scv.repeat_interleave(sub // g, 1)).unsqueeze(0)  # [1, N, U]
    offset = (mvals.double().repeat_interleave(s // g, 1) * mnv.repeat_interleave(sub // g, 1)).unsqueeze(0)
    out = torch.zeros(m, n, dtype=torch.float64)
    for xq, dx in quantize_activations(x, xb):
        xs = xq.double().view(m, k // g, g)
        dots = torch.einsum("mjc,njc->mnj", xs, qs)  # [M, N, U], exact
        bsum = xs.sum(-1).unsqueeze(1)  # [M, 1, U]
        dxu = dx.double().repeat_interleave(xb // g, 1).unsqueeze(1)  # [M, 1, U]
        out += (dxu * (scale * dots - offset * bsum)).sum(-1)
    return out if bias is None else out + bias.double()
