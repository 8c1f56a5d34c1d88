"""CUDA prefill attention falls back past a kernel that is installed but cannot run (engine/model_executor/layers/prefill_kernels.py).

PyPI's xformers 0.0.35 on torch 2.11+cu130 raised NotImplementedError ("No operator found ... xFormers wasn't built
with CUDA support") on every prefill of an H100: the engine must probe once, warn once, and serve with the next
kernel. The probe and the chain run here for real on CPU tensors: torch's varlen flash attention has no CPU kernel
(it really fails), xformers is an op that raises what PyPI's build raised, and SDPA per sequence serves.
"""
from __future__ import annotations

import logging

import pytest
import torch

from e2e_helpers import MAX_TOKENS, greedy, hf_greedy
from engine.model_executor.layers import prefill_kernels
from engine.model_executor.layers.prefill_kernels import ProbeShape, SdpaPerSequence, Xformers, select_prefill_kernel

XFORMERS_ERROR = ("No operator found for `memory_efficient_attention_forward` with inputs:\n"
                  "     query       : shape=(1, 8, 2, 3, 64) (torch.bfloat16)\n"
                  "`cutlassF-pt` is not supported because:\n"
                  "    xFormers wasn't built with CUDA support")


class _Mask:  # stands in for xformers' BlockDiagonalCausalMask, which the broken op never reads
    @staticmethod
    def from_seqlens(seq_lens):
        return seq_lens


def broken_xformers() -> Xformers:
    def op(*args, **kwargs):
        raise NotImplementedError(XFORMERS_ERROR)

    return Xformers(op=op, mask=_Mask)


class CountingSdpa(SdpaPerSequence):
    """SDPA per sequence that counts the layer calls it serves."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)


class IgnoresSpans(SdpaPerSequence):
    """Runs, but attends across the spans' boundaries: one causal SDPA over the packed batch."""

    name = "ignores spans"

    def __call__(self, query, key, value, prepared, scale):
        return super().__call__(query, key, value, [sum(prepared)], scale)


def _installed_varlen() -> list:
    try:
        return [prefill_kernels.VarlenFlash()]  # no CPU kernel: its probe fails here, as on a GPU it may
    except ImportError:
        return []  # torch < 2.10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_skips_kernels_that_fail_and_warns_once_for_each(caplog, dtype):
    shape = ProbeShape(6, 2, 64, dtype, torch.device("cpu"))
    varlen = _installed_varlen()
    sdpa = SdpaPerSequence()
    with caplog.at_level(logging.WARNING, logger="pagedserve.attention"):
        assert select_prefill_kernel([*varlen, broken_xformers(), IgnoresSpans(), sdpa], shape) is sdpa
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # Flash attention has no float32 kernel: skipped without a warning there, probed (and failing here) otherwise.
    assert len(warnings) == (0 if dtype == torch.float32 else len(varlen)) + 2
    xformers = next(w for w in warnings if w.startswith("prefill attention: xformers"))
    assert "NotImplementedError: No operator found" in xformers and "wasn't built with CUDA support" in xformers
    assert "using ignores spans instead" in xformers and "install the xformers build made for this torch" in xformers
    assert any("ignores spans cannot run" in w and "differs from causal attention" in w for w in warnings)
    assert select_prefill_kernel([], shape) is None  # the CPU: its compiled prefill kernel serves
    with pytest.raises(RuntimeError, match="no prefill attention kernel runs on cpu: xformers .*No operator found"):
        select_prefill_kernel([broken_xformers()], shape)


def test_sdpa_per_sequence_equals_the_cpu_prefill_kernel():
    """The fallback's numbers: SDPA per span (GQA by enable_gqa) equals the compiled CPU prefill kernel."""
    from engine import ops

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d, lens = 6, 2, 64, [1, 7, 20]
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    got = SdpaPerSequence()(q, k, v, lens, 0.125)
    want, start = torch.empty_like(q), 0
    for n in lens:
        rows = slice(start, start + n)
        ops.prefill_attention(want[rows], q[rows], k[rows].transpose(0, 1).unsqueeze(0),
                              v[rows].transpose(0, 1).unsqueeze(0), torch.zeros(1, dtype=torch.int32), n, 0.125, None)
        start += n
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_requests_complete_when_xformers_cannot_run(monkeypatch, caplog, tiny_llama_hd64_dir, hf_tiny64, prompt_ids):
    """An engine whose candidates are a broken xformers and SDPA (as a GPU machine with PyPI's xformers): one
    warning at start, every prefill on SDPA, and HF's greedy tokens. The head_dim-64 model: on a GPU machine the
    engine runs on CUDA, whose paged kernel refuses smaller heads."""
    from engine import LLM
    from engine.worker import model_runner

    sdpa = CountingSdpa()
    monkeypatch.setattr(model_runner, "candidates_for", lambda device: [broken_xformers(), sdpa])
    with caplog.at_level(logging.WARNING, logger="pagedserve.attention"):
        llm = LLM(model=str(tiny_llama_hd64_dir), dtype="float32", max_model_len=80, num_gpu_blocks_override=64)
    assert llm.engine.model_runner.prefill_kernel is sdpa
    prompts = prompt_ids[:3]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(ignore_eos=True), use_tqdm=False)
    assert sdpa.calls > 0  # the prefills went through the fallback, not the CPU kernel
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_tiny64, prompt, MAX_TOKENS, eos_token_id=None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.getMessage().startswith("prefill attention")]
    assert len(warnings) == 1 and "No operator found" in warnings[0]
