"""Float weights into GGUF block bytes (`--quantization q4_k`, `q4_0`, ...): torch ports of llama.cpp's
quantize_row_*_ref, so a float checkpoint quantized at load holds the bytes a GGUF file of that type would hold.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 give the bytes gguf-py's quantizer gives (gguf.quants.quantize: the same float32
arithmetic, truncation and ties); Q4_K, Q5_K follow make_qkx2_quants (a scale and a min per 32 weights, searched over
nstep candidate scales for the least weighted squared error, then rounded to 6 bits under the super-block's float16
d / dmin) and Q6_K make_qx_quants (a signed scale per 16 weights, 19 candidates, 8-bit scales under one d). Sums are
torch's (pairwise), not C's sequential ones, and a candidate's error comes from the group's sums: a K-quant byte can
differ from llama-quantize's where two candidates' errors are within rounding of each other.

quantize_rows(w [N, K], name) -> uint8 [N, K / block_weights * block_bytes], one row after another as GGUF lays
them (the K-quants in C++, csrc/cpu/ggml_quantize.cpp, where the compiled kernels are); a chunk of rows at a time, so the float temporaries stay a few MiB. fallback_type gives llama.cpp's type for a
row width the block does not divide (llama-quant.cpp's tensor_type_fallback: Q4_K -> Q5_0, Q6_K -> Q8_0, ...).
"""
from __future__ import annotations

import numpy as np
import torch

QK_K = 256
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}  # weights, bytes per block
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama.cpp's for rows not a multiple of 256
CHUNK_WEIGHTS = 1 << 20  # weights quantized at a time (the K-quant search holds ~20 float temporaries of this)
GROUP_MAX_EPS = 1e-15
GGML_K_TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # ggml type ids of the K-quants ggml_quantize.cpp writes


def fallback_type(name: str, k: int) -> str:
    """The type a row of k weights is stored in when `name` is asked for (name itself when its block divides k)."""
    if k % BLOCKS[name][0] == 0:
        return name
    fallback = FALLBACK.get(name)
    if fallback is None or k % BLOCKS[fallback][0]:
        raise ValueError(f"a row of {k} weights cannot be held as {name} (blocks of {BLOCKS[name][0]})")
    return fallback


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:  # float32 [B, ...] -> uint8 [B, 2 * ...]
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def _nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo & 0xF) | ((hi & 0xF) << 4)


def _over(a: float, t: torch.Tensor) -> torch.Tensor:
    """a / t in float32 as C divides (torch's `a / t` multiplies by t's reciprocal: another rounding)."""
    return torch.full_like(t, a) / t


def _f32(*terms: float) -> float:
    """((t0 + t1) + ...) with float32 roundings between, as C's float expressions."""
    total = np.float32(terms[0])
    for t in terms[1:]:
        total = np.float32(total + np.float32(t))
    return float(total)


def _absmax_signed(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude of each row (the first of equals, as np.argmax and llama.cpp's loop)."""
    return x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))


def _q4_0(x: torch.Tensor) -> torch.Tensor:  # x float32 [B, 32] -> uint8 [B, 18]
    d = _absmax_signed(x) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), _over(1.0, d))
    q = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _nibbles(q[:, :16], q[:, 16:])], dim=1)


def _q4_1(x: torch.Tensor) -> torch.Tensor:  # [B, 32] -> [B, 20]
    hi, lo = x.amax(dim=-1, keepdim=True), x.amin(dim=-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), _over(1.0, d))
    q = torch.trunc((x - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _nibbles(q[:, :16], q[:, 16:])], dim=1)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of 32 5-bit values, as one little-endian uint32: uint8 [B, 4] (qh of Q5_0 / Q5_1)."""
    bits = (q >> 4).view(-1, 4, 8).to(torch.int64) << torch.arange(8)
    return bits.sum(dim=-1).to(torch.uint8)


def _q5_0(x: torch.Tensor) -> torch.Tensor:  # [B, 32] -> [B, 22]
    d = _absmax_signed(x) / -16
    inv = torch.where(d == 0, torch.zeros_like(d), _over(1.0, d))
    q = torch.trunc(x * inv + 16.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _high_bits(q), _nibbles(q[:, :16], q[:, 16:])], dim=1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:  # [B, 32] -> [B, 24]
    hi, lo = x.amax(dim=-1, keepdim=True), x.amin(dim=-1, keepdim=True)
    d = (hi - lo) / 31
    inv = torch.where(d == 0, torch.zeros_like(d), _over(1.0, d))
    q = torch.trunc((x - lo) * inv + 0.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _high_bits(q), _nibbles(q[:, :16], q[:, 16:])], dim=1)


def _q8_0(x: torch.Tensor) -> torch.Tensor:  # [B, 32] -> [B, 34]
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), _over(1.0, d))
    t = x * inv
    q = (torch.sign(t) * torch.floor(t.abs() + 0.5)).to(torch.int8)  # roundf: halves away from zero
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1)


def _qkx2(x: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """make_qkx2_quants over groups of 32 (x float32 [G, 32]): (L uint8-valued int64 [G, 32], scale [G], -min [G]).
    Weights av_x + |x| (quantize_row_q4_K_ref's); the min is never above 0. As in llama.cpp, a candidate's levels
    are taken from the best min so far (x - min, over max - min). A candidate's weighted squared error is expanded
    into the group's sums (sum w (s l + m - x)^2 from sum w l^2, w l, w l x, w, w x, w x^2): [G, 1] arithmetic, not
    another pass over the weights."""
    w = (x * x).mean(dim=-1, keepdim=True).sqrt() + x.abs()
    lo = x.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = x.amax(dim=-1, keepdim=True)
    flat = hi == lo
    wx = w * x
    sum_w, sum_x, sum_x2 = w.sum(-1, keepdim=True), wx.sum(-1, keepdim=True), (wx * x).sum(-1, keepdim=True)

    def span() -> torch.Tensor:
        d = hi - lo
        return torch.where(d == 0, torch.ones_like(d), d)

    def error(s, m, l_sum, l2_sum, xl_sum):  # sum w (s l + m - x)^2
        return (s * s * l2_sum + 2 * s * m * l_sum - 2 * s * xl_sum + m * m * sum_w - 2 * m * sum_x + sum_x2)

    iscale = _over(nmax, span())
    scale = _over(1.0, iscale)
    levels = torch.round(iscale * (x - lo)).clamp(0, nmax)
    wl = w * levels
    best = error(scale, lo, wl.sum(-1, keepdim=True), (wl * levels).sum(-1, keepdim=True),
                 (wl * x).sum(-1, keepdim=True))
    for step in range(nstep + 1):
        iscale = _over(_f32(rmin, np.float32(rdelta) * np.float32(step), nmax), span())
        cand = torch.round(iscale * (x - lo)).clamp_(0, nmax)
        wl = w * cand
        sum_l, sum_l2, sum_xl = wl.sum(-1, keepdim=True), (wl * cand).sum(-1, keepdim=True), \
            (wl * x).sum(-1, keepdim=True)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = this_min > 0
        this_scale = torch.where(pos, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), this_scale)
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        err = error(this_scale, this_min, sum_l, sum_l2, sum_xl)
        better = ok & (err < best)
        levels = torch.where(better, cand, levels)
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    levels = torch.where(flat, torch.zeros_like(levels), levels)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return levels, scale.squeeze(-1), -lo.squeeze(-1)


def _k_scales(x: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int):
    """The shared part of Q4_K and Q5_K: x [B, 256] -> (L [B, 256] in [0, nmax], d, dmin float16 bytes [B, 2] each,
    the 12 packed 6-bit scale / min bytes [B, 12])."""
    b = x.shape[0]
    groups = x.view(b * 8, 32)
    levels, scales, mins = _qkx2(groups, nmax, rmin, rdelta, nstep)
    scales, mins = scales.view(b, 8), mins.view(b, 8)
    max_scale = scales.amax(dim=1, keepdim=True).clamp(min=0)
    max_min = mins.amax(dim=1, keepdim=True).clamp(min=0)
    inv_scale = torch.where(max_scale > 0, _over(63.0, max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _over(63.0, max_min), torch.zeros_like(max_min))
    # uint8_t ls = nearest_int(...): a negative value wraps before MIN(63, .)
    ls = torch.remainder(torch.round(inv_scale * scales).to(torch.int64), 256).clamp(max=63)
    lm = torch.remainder(torch.round(inv_min * mins).to(torch.int64), 256).clamp(max=63)
    packed = torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                        (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], dim=1).to(torch.uint8)
    d16, dmin16 = (max_scale / 63).to(torch.float16), (max_min / 63).to(torch.float16)
    d = d16.float() * ls.float()  # [B, 8]
    dm = dmin16.float() * lm.float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    requant = torch.round((x.view(b, 8, 32) + dm.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, nmax)
    levels = torch.where((d == 0).unsqueeze(-1), levels.view(b, 8, 32), requant).to(torch.int64).view(b, 256)
    return levels, d16.view(torch.uint8).view(b, 2), dmin16.view(torch.uint8).view(b, 2), packed


def _q4_k(x: torch.Tensor) -> torch.Tensor:  # [B, 256] -> [B, 144]: d, dmin, scales[12], qs[128]
    levels, d, dmin, scales = _k_scales(x, 15, -1.0, 0.1, 20)
    l4 = levels.view(-1, 4, 2, 32)  # 64 weights a run: the first 32 in the low nibbles, the next 32 in the high
    qs = _nibbles(l4[:, :, 0], l4[:, :, 1]).to(torch.uint8).view(-1, 128)
    return torch.cat([d, dmin, scales, qs], dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:  # [B, 256] -> [B, 176]: d, dmin, scales[12], qh[32], qs[128]
    levels, d, dmin, scales = _k_scales(x, 31, -0.5, 0.1, 15)
    l8 = levels.view(-1, 8, 32)
    qh = ((l8 >> 4) << torch.arange(8).view(1, 8, 1)).sum(dim=1).to(torch.uint8)  # bit i: group i's bit 4
    l4 = levels.view(-1, 4, 2, 32)
    qs = _nibbles(l4[:, :, 0], l4[:, :, 1]).to(torch.uint8).view(-1, 128)
    return torch.cat([d, dmin, scales, qh, qs], dim=1)


def _qx(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants with rmse_type 1 (weights x^2) over groups (x [G, n]): (L = l + nmax [G, n], scale [G])."""
    peak = _absmax_signed(x)
    zero = peak.abs() < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    w = x * x

    def trial(iscale: torch.Tensor):
        lv = torch.round(iscale * x).clamp(-nmax, nmax - 1)
        return lv, (w * x * lv).sum(-1, keepdim=True), (w * lv * lv).sum(-1, keepdim=True)

    levels, sumlx, suml2 = trial(_over(-nmax, peak))
    scale = torch.where(suml2 != 0, sumlx / torch.where(suml2 != 0, suml2, torch.ones_like(suml2)),
                        torch.zeros_like(suml2))
    best = scale * sumlx
    for step in [s for s in range(-9, 10) if s != 0]:
        lv, sumlx, suml2 = trial(_over(-_f32(nmax, np.float32(0.1) * np.float32(step)), peak))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = torch.where(better, lv, levels)
        scale = torch.where(better, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), scale)
        best = torch.where(better, scale * sumlx, best)
    levels = torch.where(zero, torch.zeros_like(levels) - nmax, levels) + nmax
    return levels.to(torch.int64), torch.where(zero, torch.zeros_like(scale), scale).squeeze(-1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:  # [B, 256] -> [B, 210]: ql[128], qh[64], scales[16] int8, d
    b = x.shape[0]
    levels, scales = _qx(x.view(b * 16, 16), 32)
    levels, scales = levels.view(b, 16, 16), scales.view(b, 16)
    top = _absmax_signed(scales)  # [B, 1]
    zero = top.abs() < GROUP_MAX_EPS
    iscale = _over(-128.0, torch.where(zero, torch.ones_like(top), top))
    d16 = torch.where(zero, torch.zeros_like(top), _over(1.0, iscale)).to(torch.float16)
    sc = torch.round(iscale * scales).clamp(max=127).to(torch.int64)  # >= -128: |scales| <= |top|
    sc = torch.where(zero, torch.zeros_like(sc), sc)
    d = d16.float() * sc.float()  # [B, 16]
    safe = torch.where(d == 0, torch.ones_like(d), d)
    requant = torch.round(x.view(b, 16, 16) / safe.unsqueeze(-1)).clamp(-32, 31) + 32
    levels = torch.where((d == 0).unsqueeze(-1), levels, requant.to(torch.int64))
    levels = torch.where(zero.unsqueeze(-1), torch.zeros_like(levels), levels).view(b, 2, 4, 32)  # halves of 128
    ql = _nibbles(levels[:, :, 0:2], levels[:, :, 2:4]).to(torch.uint8).reshape(b, 128)
    qh = ((levels >> 4) << torch.tensor([0, 2, 4, 6]).view(1, 1, 4, 1)).sum(dim=2).to(torch.uint8).reshape(b, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), d16.view(torch.uint8).view(b, 2)], dim=1)


_QUANTIZE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
             "Q5_K": _q5_k, "Q6_K": _q6_k}


def row_bytes(name: str, k: int) -> int:
    weights, nbytes = BLOCKS[name]
    return k // weights * nbytes


@torch.no_grad()
def quantize_rows(weight: torch.Tensor, name: str, compiled: bool = True) -> torch.Tensor:
    """weight [N, K] (any float dtype; K a multiple of the type's block) as `name`'s GGUF blocks: uint8
    [N, row_bytes(name, K)]. The K-quants run csrc/cpu/ggml_quantize.cpp (llama.cpp's C arithmetic, ~100x this
    port's speed) where the compiled CPU kernels are, unless compiled=False (the torch port, the reference)."""
    n, k = weight.shape
    block, nbytes = BLOCKS[name]
    if k % block:
        raise ValueError(f"{name} needs rows of a multiple of {block} weights, got {k}")
    if name in GGML_K_TYPES and compiled:
        from engine import ops

        step = max(1, 8 * CHUNK_WEIGHTS // k)  # float32 copies of a few rows at a time, never the whole weight
        parts = [ops.ggml_quantize_k(weight[r:r + step].float().contiguous(), GGML_K_TYPES[name])
                 for r in range(0, n, step)]
        if all(p is not None for p in parts):
            return torch.cat(parts) if len(parts) > 1 else parts[0]
    out = torch.empty(n, k // block * nbytes, dtype=torch.uint8)
    step = max(1, CHUNK_WEIGHTS // k)
    for r in range(0, n, step):
        x = weight[r:r + step].float().reshape(-1, block)
        out[r:r + step] = _QUANTIZE[name](x).view(-1, out.shape[1])
    return out
