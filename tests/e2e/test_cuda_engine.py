"""The engine on CUDA: the head_dim-64 tiny model through the compiled CUDA kernels matches HF, and keeps its
outputs under preemption by swap and by recompute, prefix caching and beam search.

On a machine without CUDA only the CPU run of the parity test runs: it proves the model itself works."""
from __future__ import annotations

import pytest
import torch

from e2e_helpers import MAX_MODEL_LEN, MAX_TOKENS, blocks_for, greedy, hf_greedy, seeded_pair, token_ids
from engine import ops
from engine.sampling_params import SamplingParams
from test_beam_search import BEAM_TOKENS, hf_beams
from test_prefix_caching import PREFIX, QUESTIONS

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def cuda_llm(make_llm):
    """The tiny64 engine on CUDA, which must run the compiled CUDA kernels (a reference run proves nothing)."""
    llm = make_llm("tiny64", device="cuda")
    assert ops.backend() is ops.OpsBackend.COMPILED_CUDA
    return llm


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_hd64_model_greedy_matches_hf(make_llm, hf_tiny64, prompt_ids, device):
    prompts = prompt_ids if device == "cuda" else [prompt_ids[0], prompt_ids[-1]]  # CPU: two, to stay cheap
    llm = make_llm("tiny64", device=device)
    assert llm.engine.model_runner.device.type == device
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_tiny64, prompt, MAX_TOKENS, eos_token_id=None)


@CUDA
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cuda_outputs_survive_preemption(make_llm, cuda_llm, prompt_ids, mode):
    reference = [token_ids(cuda_llm.generate(prompt_token_ids=prompt_ids, sampling_params=p, use_tqdm=False))
                 for p in (greedy(ignore_eos=True), seeded_pair(ignore_eos=True))]
    llm = make_llm("tiny64", device="cuda", num_gpu_blocks_override=2 * blocks_for(MAX_MODEL_LEN) + 1,
                   preemption_mode=mode)
    got = [token_ids(llm.generate(prompt_token_ids=prompt_ids, sampling_params=p, use_tqdm=False))
           for p in (greedy(ignore_eos=True), seeded_pair(ignore_eos=True))]
    assert getattr(llm.engine.get_stats(), f"num_preemptions_{mode}") > 0
    assert got == reference


@CUDA
def test_cuda_prefix_caching_keeps_outputs(make_llm, cuda_llm, smol_tokenizer):
    prompts = [smol_tokenizer(PREFIX + q).input_ids for q in QUESTIONS]
    cached = make_llm("tiny64", device="cuda", enable_prefix_caching=True)

    def generate(llm):
        first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=greedy(ignore_eos=True), use_tqdm=False)
        rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=greedy(ignore_eos=True), use_tqdm=False)
        return token_ids(first + rest)

    assert generate(cached) == generate(cuda_llm)
    assert cached.engine.get_stats().prefix_cache_hit_rate > 0


@CUDA
def test_cuda_beam_search_matches_hf(cuda_llm, hf_tiny64, prompt_ids):
    prompts = [prompt_ids[1], prompt_ids[-1]]
    params = SamplingParams(n=3, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=BEAM_TOKENS,
                            ignore_eos=True)
    outputs = cuda_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert [c.token_ids for c in out.outputs] == hf_beams(hf_tiny64, prompt, 3, 1.0, False, None)


@CUDA
def test_cuda_graphs_serve_decode_steps_with_the_eager_tokens(make_llm, cuda_llm, prompt_ids):
    """Decode-only steps replay a captured graph (one per batch size, padded rows attend to nothing) and give
    the tokens of the same engine run op by op (--enforce-eager), greedy and seeded."""
    eager = make_llm("tiny64", device="cuda", enforce_eager=True)
    assert eager.engine.model_runner.graphs is None
    graphs = cuda_llm.engine.model_runner.graphs
    assert graphs is not None and graphs.sizes[:4] == [1, 2, 4, 8]
    before = graphs.replays
    for params in (greedy(ignore_eos=True), seeded_pair(ignore_eos=True)):
        got = token_ids(cuda_llm.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False))
        want = token_ids(eager.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False))
        assert got == want
    assert graphs.replays - before >= 2 * (MAX_TOKENS - 1)  # every decode-only step of both runs replayed


@CUDA
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cuda_graphs_keep_eager_tokens_under_preemption(make_llm, prompt_ids, mode):
    eager = make_llm("tiny64", device="cuda", enforce_eager=True)
    pressed = make_llm("tiny64", device="cuda", num_gpu_blocks_override=2 * blocks_for(MAX_MODEL_LEN) + 1,
                       preemption_mode=mode)
    for params in (greedy(ignore_eos=True), seeded_pair(ignore_eos=True)):
        got = token_ids(pressed.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False))
        assert got == token_ids(eager.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False))
    assert getattr(pressed.engine.get_stats(), f"num_preemptions_{mode}") > 0
    assert pressed.engine.model_runner.graphs.replays > 0


@CUDA
def test_cuda_graphs_are_captured_again_after_an_engine_reset(make_llm, prompt_ids):
    llm = make_llm("tiny64", device="cuda", max_num_seqs=24)
    want = token_ids(llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True),
                                  use_tqdm=False))
    old = llm.engine.model_runner.graphs
    llm.engine.reset()  # a new KV cache: the old graphs hold the old one's addresses
    graphs = llm.engine.model_runner.graphs
    assert graphs is not old and graphs.kv_caches is llm.engine.cache_engine.device_cache
    assert graphs.sizes == [1, 2, 4, 8, 16, 24]
    got = token_ids(llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True),
                                 use_tqdm=False))
    assert got == want and graphs.replays > 0


def _family_hd64(family: str):
    """Each family's spec at head_dim 64 (a CUDA kernel size), GQA, windows shorter than the prompts."""
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config

    tiny = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                pad_token_id=2)
    gemma = dict(query_pre_attn_scalar=48, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    return {
        "qwen3": lambda: Qwen3Config(**tiny, tie_word_embeddings=False),
        "gemma3": lambda: Gemma3TextConfig(**tiny, **gemma, final_logit_softcapping=30.0),
        "gemma2": lambda: Gemma2Config(**tiny, **gemma, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                       initializer_range=0.5),
        "phi3": lambda: Phi3Config(**tiny, sliding_window=8, tie_word_embeddings=False),
    }[family]()


@CUDA
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_cuda_families_greedy_match_hf(tmp_path, default_model_dir, prompt_ids, family, enforce_eager):
    """Every family on CUDA (the CUDA kernels where they exist, torch's ops for q/k norms, GELU-tanh and Gemma 2's
    capped attention), with and without CUDA graphs: HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from tiny_models import save_random_model

    folder = save_random_model(_family_hd64(family), tmp_path, default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(model=str(folder), device="cuda", dtype="float32", max_model_len=MAX_MODEL_LEN,
              num_gpu_blocks_override=64, enforce_eager=enforce_eager)
    try:
        outputs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompt_ids, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos_token_id=None)
