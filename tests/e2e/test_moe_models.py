"""Mixture-of-experts models (engine/model_executor/layers/moe.py) end to end: random-weight HF checkpoints built
in-process (Mixtral: 4 experts, top-2; Qwen3-MoE: 8 experts top-2 with a dense layer, 16 experts top-8 on every
second layer), greedy tokens equal to HF transformers' (float32) on the compiled CPU step
and the eager path, with a roomy cache, under preemption by swap (with prefix caching) and by recompute; the
compiled step taken; int8 (Q8_0) experts compiled == eager; two tensor-parallel ranks give one rank's tokens;
Qwen2-MoE's shared expert on every path; GGUF files' experts in their own blocks (Q8_0, and llama-quantize's Q4_K_M:
Q4_K gate / up, Q6_K and Q4_K down) against the same file dequantized."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from e2e_helpers import MAX_MODEL_LEN, MAX_TOKENS, ROOMY, blocks_for, greedy, hf_greedy, token_ids
from engine import ops
from tiny_models import save_random_model, tiny_mixtral_config, tiny_qwen2_moe_config, tiny_qwen3_moe_config

pytestmark = pytest.mark.skipif(ops.backend() is not ops.OpsBackend.COMPILED_CPU, reason="needs the compiled CPU ops")

CONFIGS = {
    "mixtral": tiny_mixtral_config,
    "qwen3moe-top2": tiny_qwen3_moe_config,  # layer 1 dense (mlp_only_layers), norm_topk_prob
    # 16 experts, top-8 without renormalisation, every second layer sparse (decoder_sparse_step 2)
    "qwen3moe-top8": lambda: tiny_qwen3_moe_config(num_experts=16, num_experts_per_tok=8, norm_topk_prob=False,
                                                   decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=2),
    "qwen2moe": tiny_qwen2_moe_config,  # a shared expert with its sigmoid gate, q/k/v biases, top-2 not renormalised
}
CONDITIONS = {
    "roomy": {},
    "swap+prefix": dict(num_gpu_blocks_override=2 * blocks_for(MAX_MODEL_LEN) + 1, preemption_mode="swap",
                        enable_prefix_caching=True),
    "recompute": dict(num_gpu_blocks_override=2 * blocks_for(MAX_MODEL_LEN) + 1, preemption_mode="recompute"),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, default_model_dir):
    return {name: save_random_model(make(), tmp_path_factory.mktemp(name), default_model_dir)
            for name, make in CONFIGS.items()}


@pytest.fixture(scope="module")
def hf_outputs(moe_dirs, prompt_ids):
    """HF's float32 greedy tokens per model and prompt (EOS ignored)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, folder in moe_dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        out[name] = [hf_greedy(hf, p, MAX_TOKENS, eos_token_id=None) for p in prompt_ids]
    return out


def _run(folder, prompt_ids, **kwargs):
    from engine import LLM

    llm = LLM(model=str(folder), **{**ROOMY, **kwargs})
    try:
        before = llm.engine.get_stats()
        rounds = 2 if kwargs.get("enable_prefix_caching") else 1  # the second round's prompts hit the cache
        for _ in range(rounds):
            outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True),
                                use_tqdm=False)
        stats = llm.engine.get_stats()
        model = llm.engine.model_runner.model
        plan = model.compiled_plan() if model.compiled_decode else None
        return [c[0] for c in token_ids(outs)], stats, before, (plan.steps_run if plan is not None else 0), model
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("condition", sorted(CONDITIONS))
def test_greedy_tokens_equal_hf(moe_dirs, hf_outputs, prompt_ids, name, condition):
    kwargs = CONDITIONS[condition]
    for eager in (False, True):
        tokens, stats, before, compiled_steps, _ = _run(moe_dirs[name], prompt_ids, enforce_eager=eager, **kwargs)
        assert (compiled_steps == 0) if eager else (compiled_steps >= MAX_TOKENS - 1), (eager, compiled_steps)
        if condition != "roomy":
            mode = kwargs["preemption_mode"]
            assert getattr(stats, f"num_preemptions_{mode}") > getattr(before, f"num_preemptions_{mode}")
        if kwargs.get("enable_prefix_caching"):
            assert stats.prefix_cache_hit_rate > 0
        assert tokens == hf_outputs[name], f"{name} {condition} enforce_eager={eager}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_int8_experts_compiled_equals_eager(moe_dirs, prompt_ids, name):
    runs = {}
    for eager in (False, True):
        tokens, _, _, steps, model = _run(moe_dirs[name], prompt_ids, enforce_eager=eager, quantization="int8")
        moe = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "packed")]
        assert moe and all(m.packed[0].dtype == torch.uint8 and m.w13.numel() == 0 for m in moe)
        assert (steps == 0) if eager else steps > 0
        runs[eager] = tokens
    assert runs[False] == runs[True]


def test_two_ranks_give_the_tokens_of_one(moe_dirs, hf_outputs, prompt_ids):
    """Each rank holds half of every expert's intermediate; the greedy tokens are one rank's (and HF's)."""
    from engine import LLM

    name = "qwen3moe-top2"
    llm = LLM(model=str(moe_dirs[name]), tensor_parallel_size=2, **ROOMY)
    try:
        outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [c[0] for c in token_ids(outs)] == hf_outputs[name]


LLAMA_CPP = sorted(Path.home().glob(".cache/pagedserve/llama.cpp-*/src/vendor/llama.cpp/convert_hf_to_gguf.py"))


@pytest.mark.skipif(not LLAMA_CPP, reason="llama.cpp's converter is not in the cache (benchmarks/peers.sh builds it)")
def test_q8_0_gguf_experts_load_natively(tmp_path, default_model_dir, prompt_ids):
    """llama.cpp's converter's Q8_0 file of a Qwen3-MoE (qwen3moe: ffn_gate_inp, ffn_gate/up/down_exps 3-D) is
    served from its blocks: the packed experts' bytes and the greedy tokens are `--quantization int8`'s of the
    HF folder (gguf-py and quant.py quantize alike; the router stays float in both)."""
    folder = save_random_model(tiny_qwen3_moe_config(mlp_only_layers=[]), tmp_path / "hf", default_model_dir)
    gguf_file = tmp_path / "moe-q8_0.gguf"
    converter = LLAMA_CPP[-1]
    env = dict(os.environ, PYTHONPATH=str(converter.parent / "gguf-py"))
    subprocess.run([sys.executable, str(converter), str(folder), "--outtype", "q8_0", "--outfile", str(gguf_file)],
                   check=True, env=env, capture_output=True)
    runs = {}
    for name, kwargs in (("gguf", dict(model=str(gguf_file))), ("int8", dict(model=str(folder),
                                                                             quantization="int8"))):
        tokens, _, _, _, model = _run(kwargs.pop("model"), prompt_ids, **kwargs)
        runs[name] = (tokens, [m.mlp.packed for m in model.layers])
    assert runs["gguf"][0] == runs["int8"][0]
    for (a13, a2), (b13, b2) in zip(runs["gguf"][1], runs["int8"][1]):
        assert a13.dtype == torch.uint8 and torch.equal(a13, b13) and torch.equal(a2, b2)


QUANTIZE = sorted(Path.home().glob(".cache/pagedserve/llama.cpp-*/build/bin/llama-quantize"))


def _dequantized_folder(gguf_file: Path, hf_folder: Path, out: Path) -> Path:
    """hf_folder with every weight replaced by gguf_file's tensor dequantized to float32 (llama.cpp's
    dequantize_row arithmetic: formats.py, equal to gguf-py's), experts split back per expert: the file's own
    numbers as a float checkpoint, the reference a natively served file is held to."""
    from safetensors.torch import load_file, save_file

    from engine.model_executor.gguf_file import header, hf_name, read_bytes
    from engine.model_executor.layers.ggml_linears import rows_dequantizer

    out.mkdir()
    for f in hf_folder.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    state = load_file(str(hf_folder / "model.safetensors"))
    arch, infos = header(gguf_file)
    with open(gguf_file, "rb") as f:
        for info in infos:
            name = hf_name(info.name, arch)
            rows = math.prod(info.shape[:-1])  # 1 for a vector
            w = rows_dequantizer(info.kind, info.shape[-1])(read_bytes(f, info).view(rows, -1)).view(info.shape)
            if len(info.shape) == 3:  # [E, rows, K] -> each expert's own tensor
                layer, proj = name.rsplit(".experts.", 1)
                for e in range(info.shape[0]):
                    state[f"{layer}.experts.{e}.{proj}"] = w[e].clone()
            else:
                assert state[name].shape == w.shape, (name, w.shape)
                state[name] = w.clone()
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.skipif(not LLAMA_CPP or not QUANTIZE, reason="llama.cpp's converter and llama-quantize are not in the "
                    "cache (benchmarks/peers.sh builds them)")
def test_q4_k_m_gguf_experts_load_natively(tmp_path, default_model_dir, prompt_ids, caplog):
    """llama-quantize's Q4_K_M of a Qwen3-MoE (3 sparse layers, 8 experts of 256, hidden 256: whole Q4_K blocks)
    holds its experts as Q4_K gate / up and Q6_K (last layer) or Q4_K down: served in those blocks, one kquant_gemm
    blob an expert (the packed bytes within 4 % of the file's), no fallback warning, and the greedy tokens, compiled
    and eager, are those of the same file's weights dequantized to a float32 checkpoint."""
    import logging

    from engine import LLM
    from engine.model_executor.gguf_file import header
    from engine.model_executor.layers.formats import FORMATS

    config = tiny_qwen3_moe_config(hidden_size=256, moe_intermediate_size=256, mlp_only_layers=[],
                                   tie_word_embeddings=True)
    folder = save_random_model(config, tmp_path / "hf", default_model_dir)
    f32, gguf_file = tmp_path / "moe-f32.gguf", tmp_path / "moe-q4_k_m.gguf"
    converter = LLAMA_CPP[-1]
    env = dict(os.environ, PYTHONPATH=str(converter.parent / "gguf-py"))
    subprocess.run([sys.executable, str(converter), str(folder), "--outtype", "f32", "--outfile", str(f32)],
                   check=True, env=env, capture_output=True)
    # the tied head / embedding (49152 x 256) as Q8_0, not Q6_K: its repack at load would be most of this test's time
    subprocess.run([str(QUANTIZE[-1]), "--token-embedding-type", "q8_0", str(f32), str(gguf_file), "Q4_K_M"],
                   check=True, capture_output=True)
    infos = {i.name: i for i in header(gguf_file)[1]}
    kinds = [[infos[f"blk.{i}.ffn_{p}_exps.weight"].kind for p in ("gate", "up", "down")] for i in range(3)]
    assert kinds == [["Q4_K", "Q4_K", "Q4_K"], ["Q4_K", "Q4_K", "Q4_K"], ["Q4_K", "Q4_K", "Q6_K"]], kinds

    runs = {}
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(gguf_file), **ROOMY)
    try:
        assert not [r for r in caplog.records if "held as" in r.getMessage()]
        model = llm.engine.model_runner.model
        for eager in (True, False):  # one engine, both paths
            model.compiled_decode = not eager
            outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True), use_tqdm=False)
            runs[eager] = [c[0] for c in token_ids(outs)]
        assert model.compiled_plan().steps_run >= MAX_TOKENS - 1
    finally:
        llm.shutdown()
    e, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    for i, layer in enumerate(model.layers):
        w13, w2 = layer.mlp.packed
        assert w13.dtype == w2.dtype == torch.int8 and w13.shape[0] == w2.shape[0] == e
        assert w13.shape[1] == 128 + 2 * FORMATS["Q4_K"].packed_bytes(inter, hidden)  # header + gate | up parts
        assert w2.shape[1] == 128 + FORMATS[kinds[i][2]].packed_bytes(hidden, inter)
        file_bytes = sum(infos[f"blk.{i}.ffn_{p}_exps.weight"].nbytes for p in ("gate", "up", "down"))
        # per 16 rows x 256 weights the file's Q4_K holds 2304 bytes, the packed tile 2368 (6-bit scales as int8),
        # Q6_K 3360 against 3360; each expert's blob a 128-byte header besides
        assert file_bytes < w13.nbytes + w2.nbytes < 1.04 * file_bytes
    reference, _, _, _, _ = _run(_dequantized_folder(gguf_file, folder, tmp_path / "dequantized"), prompt_ids,
                                 enforce_eager=True)
    assert runs[False] == runs[True] == reference
