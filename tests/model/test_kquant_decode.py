"""A tiny random Llama whose linears hold GGML block formats (engine/model_executor/layers/formats.py
attach_quantized_linear) as a Q4_K_M file has them: qkv q and k Q4_K with v Q6_K, o Q4_K, gate_up Q4_K | Q5_K,
down Q6_K. The compiled step (csrc/cpu/decode_layers.cpp's linear() dispatch to kquant_gemm) equals the eager step
bit for bit, in float32 and bfloat16."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig

from engine import ops
from engine.llm import LLM
from engine.model_executor.layers.formats import FORMATS, attach_quantized_linear, format_of
from engine.sampling_params import SamplingParams
from kernels.test_formats import random_rows
from tiny_models import save_random_model

pytestmark = pytest.mark.skipif(ops.backend() is not ops.OpsBackend.COMPILED_CPU or ops.kquant_gemm_isa() == 0,
                                reason="needs the compiled CPU ops")

# K a multiple of 256 everywhere (the K-quants' super-block): hidden 256, intermediate 512.
CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
SCALE = {"Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 2e-5}  # weights of a few hundredths


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return save_random_model(LlamaConfig(**CONFIG), tmp_path_factory.mktemp("kquant"), default_model_dir, seed=5)


def _quantize(model) -> None:
    """Random blocks for every decoder linear, the same on every call."""
    h, q, kv, inter = 256, 256, 128, 512
    layout = {"qkv_proj": [("Q4_K", q), ("Q4_K", kv), ("Q6_K", kv)], "o_proj": [("Q4_K", h)],
              "gate_up_proj": [("Q4_K", inter), ("Q5_K", inter)], "down_proj": [("Q6_K", h)]}
    seed = 0
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            name = next(n for n, m in layer.named_modules() if m is linear).split(".")[-1]
            parts = []
            for fmt, rows in layout[name]:
                seed += 1
                parts.append((FORMATS[fmt], random_rows(fmt, rows, linear.in_features, seed, SCALE[fmt])))
            attach_quantized_linear(linear, parts)
            assert [f.name for f, _ in format_of(linear)] == [f for f, _ in layout[name]]
    model._compiled_plan = None


def _run(model_dir, enforce_eager: bool, dtype: str = "float32"):
    llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=enforce_eager, max_model_len=128, block_size=16,
              num_gpu_blocks_override=64, num_cpu_blocks_override=16, seed=0)
    model = llm.engine.model_runner.model
    _quantize(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in (1, 5, 13, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False), model.compiled_plan()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_step_equals_eager_bit_for_bit(model_dir, dtype):
    compiled, plan = _run(model_dir, enforce_eager=False, dtype=dtype)
    eager, eager_plan = _run(model_dir, enforce_eager=True, dtype=dtype)
    assert plan is not None and plan.steps_run >= 11, "the decode steps ran compiled"
    assert eager_plan is None or eager_plan.steps_run == 0
    for a, b in zip(compiled, eager, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
