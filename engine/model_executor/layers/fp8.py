"""fp8 (e4m3) weights (issue 42, `--quantization fp8`): every decoder linear's weight held as float8_e4m3fn with one
float32 scale per output channel, its activations quantized per token at each call, the product through torch's
scaled matmul (torch._scaled_mm: cuBLASLt's fp8 GEMM on Hopper and Ada GPUs, compute capability 8.9+).

The weights are quantized at load from the checkpoint's floats (vLLM's "dynamic" fp8: no calibration, no fp8
checkpoint needed): a step reads half the weight bytes of bfloat16, and the KV cache gets the memory they gave
back. The head and the embedding stay in the model's dtype (as in vLLM: the logits are the most sensitive product).

Numbers: w ~= q_w * s_w with s_w = amax(|w_row|) / 448 (448: e4m3's largest finite value), x ~= q_x * s_x per token
likewise; y = (q_x @ q_w^T) * s_x * s_w^T, the fp8 products summed in float32 and scaled before the one rounding to
the output dtype (bfloat16). ref_fp8_linear is that arithmetic in plain float32 torch: the tests hold the scaled
matmul to it.

On a CPU, torch's scaled matmul is a reference implementation (~25x slower than the bfloat16 linear, 2 vCPU Xeon):
fp8 runs there so that the path is checked without a GPU; `--quantization int8` is the CPU's quantized path.
"""
from __future__ import annotations

import functools
import logging
import types
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9) and Hopper (9.0) on
ALIGN = 16  # cuBLASLt's fp8 GEMM wants K and N multiples of 16 (a linear that is not keeps its float weight)
_MIN_SCALE = 1e-12  # an all-zero row or token: any positive scale gives zeros


def fp8_unavailable(device: torch.device, capability: Optional[tuple[int, int]] = None) -> Optional[str]:
    """Why fp8 cannot run on device (None: it can). capability: the GPU's (major, minor), default the device's."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"this torch ({torch.__version__}) has no fp8 scaled matmul"
    if device.type == "cuda":
        if capability is None:
            capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < MIN_CAPABILITY:
            return (f"fp8 needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, "
                    f"Hopper); this one is {capability[0]}.{capability[1]}")
        return None
    if device.type == "cpu":
        return None if _cpu_scaled_mm_runs() else "this torch's CPU build has no fp8 scaled matmul"
    return f"fp8 runs on CUDA and CPU, not on {device.type}"


@functools.lru_cache(maxsize=1)
def _cpu_scaled_mm_runs() -> bool:
    try:
        a = torch.zeros(1, ALIGN, dtype=FP8)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(1, 1), scale_b=torch.ones(1, 1), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] as e4m3 values and one float32 scale: (q FP8 [M, K], s float32 [M, 1]), x ~= q * s.
    s = amax(|row|) / 448, so the row's largest value maps to e4m3's largest; the cast rounds to nearest even."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=_MIN_SCALE)
    q = (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s


def fp8_gemm(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, bias: Optional[torch.Tensor],
             out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] (float) times the fp8 weight q_w [N, K] with its scales s_w float32 [1, N]: [M, N] in out_dtype."""
    if x.shape[0] == 0:
        return x.new_empty(0, q_w.shape[0], dtype=out_dtype)
    q_x, s_x = quantize_fp8_rows(x)
    # _scaled_mm wants mat2 column-major: q_w.t() of the row-major [N, K] weight is exactly that.
    out = torch._scaled_mm(q_x, q_w.t(), scale_a=s_x, scale_b=s_w, out_dtype=out_dtype)
    return out if bias is None else out.add_(bias)


def ref_fp8_linear(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp8_gemm's arithmetic in plain float32 torch (the reference the tests hold the scaled matmul to): float32
    [M, N], rounded by the caller."""
    q_x, s_x = quantize_fp8_rows(x)
    out = (q_x.float() @ q_w.float().t()) * s_x * s_w
    return out if bias is None else out + bias.float()


def _fp8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, self.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = fp8_gemm(x2, self._fp8_weight, self._fp8_scale, self.bias, self._fp8_out_dtype)
    return out.view(*lead, self.out_features)


def attach_fp8_linear(linear: nn.Linear, q_w: torch.Tensor, s_w: torch.Tensor, out_dtype: torch.dtype) -> None:
    """linear now multiplies through fp8_gemm with q_w FP8 [N, K] and s_w float32 [N] (or [1, N]); its float weight
    is released (an empty parameter of its dtype and device stays, so code that asks for them still can)."""
    linear._fp8_weight = q_w
    linear._fp8_scale = s_w.reshape(1, -1).float().contiguous()
    linear._fp8_out_dtype = out_dtype
    linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
    linear.forward = types.MethodType(_fp8_forward, linear)


def fp8_quantizable(linear: nn.Linear, model: nn.Module) -> bool:
    """A linear that gets fp8 weights: not the head (its logits are the most sensitive product, and a tied head
    shares the embedding), and K and N multiples of ALIGN."""
    return (linear is not getattr(model, "lm_head", None) and linear.weight.numel() > 0
            and linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0)


@torch.no_grad()
def quantize_linears_fp8(model: nn.Module) -> int:
    """`--quantization fp8` on a loaded float model: each decoder linear (fp8_quantizable) gets e4m3 weights with
    per-output-channel scales, its float weight released as soon as its fp8 copy exists. Returns how many."""
    count, kept = 0, []
    for name, linear in model.named_modules():
        if type(linear) is not nn.Linear:
            continue
        if not fp8_quantizable(linear, model):
            if linear is not getattr(model, "lm_head", None):
                kept.append(name)
            continue
        q_w, s_w = quantize_fp8_rows(linear.weight)
        attach_fp8_linear(linear, q_w, s_w, linear.weight.dtype)
        count += 1
    if kept:
        logger.warning("fp8: %d linears keep their float weights (K or N not a multiple of %d): %s", len(kept),
                       ALIGN, ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else ""))
    logger.info("quantized %d linear layers to fp8 (e4m3, a scale per output channel)", count)
    return count
