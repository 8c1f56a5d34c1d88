"""The loader: the default model's GGUF -> safetensors cache, HF folders, dummy weights, clear refusals."""
from __future__ import annotations

import json

import pytest
import torch

from tiny_models import copy_tokenizer, save_random_model, tiny_llama_config
from engine.model_executor import loader
from engine.config import EngineConfig


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.mark.slow
def test_gguf_and_its_converted_cache_give_identical_weights_and_tokenizer(default_model_dir):
    from_cache = loader.load_model(EngineConfig(model=str(default_model_dir), device="cpu"), pack_cpu_linears=False)
    # quantization none: the file dequantized (served as it is, its Q4_1 blocks would hold no float weights)
    from_gguf = loader.load_model(EngineConfig(model=str(loader.default_gguf_path()), device="cpu",
                                               quantization="none"), pack_cpu_linears=False)
    a, b = _params(from_cache.model), _params(from_gguf.model)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    tok_a, tok_b = from_cache.tokenizer, from_gguf.tokenizer
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert tok_a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok_b.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok_a.eos_token == tok_b.eos_token == "<|im_end|>"
    text = "Hello world, <|im_start|>user\nhi<|im_end|>"
    assert tok_a(text).input_ids == tok_b(text).input_ids


def test_default_model_is_the_q4_1_file_where_its_blocks_run_else_the_folder(default_model_dir, capsys):
    from engine.model_executor.gguf_native import is_native_gguf

    gguf = loader.default_gguf_path()
    cpu_default = gguf if is_native_gguf(gguf) else default_model_dir
    assert loader.default_model_for(EngineConfig(device="cpu")) == cpu_default
    assert loader.main(["--device", "cpu"]) == 0 and loader.main([]) == 0  # the CPU image's build step; make's
    assert capsys.readouterr().out.split() == [str(cpu_default), str(default_model_dir)]
    for fields in (dict(quantization="int8"), dict(quantization="none"), dict(load_format="safetensors"),
                   dict(tensor_parallel_size=2)):
        assert loader.default_model_for(EngineConfig(device="cpu", **fields)) == default_model_dir, fields


@pytest.mark.slow
def test_default_model_served_as_q4_1_blocks_gives_the_float32_folders_greedy_tokens(default_model_dir):
    """What `pagedserve serve` with no --model runs (the package's Q4_1 file as its blocks, float32 activations)
    decodes the tokens of the float32 folder it used to serve (that file dequantized), prompt by prompt."""
    from engine import LLM
    from engine.model_executor.gguf_native import is_native_gguf
    from engine.sampling_params import SamplingParams

    if not is_native_gguf(loader.default_gguf_path()):
        pytest.skip("no block kernels for this CPU: the default is the folder itself")
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Hi", "Once upon a time, in a land far away,",
               "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = []
    for model in (None, str(default_model_dir)):
        llm = LLM(model, max_model_len=256, kv_cache_space=0.05, swap_space=0.01, seed=0)
        assert llm.engine.config.model_name == "SmolLM2-135M-Instruct"
        outputs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert outputs[0] == outputs[1]


def test_default_model_folder_keeps_chat_template_and_eos(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token_id == 2 and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_interrupted_conversion_leaves_no_cache_behind(tmp_path, monkeypatch, default_model_dir):
    import transformers

    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    # Real tokenizer and a real (tiny) model stand in for the slow GGUF reads; the save is killed halfway.
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: transformers.PreTrainedTokenizerFast.from_pretrained(str(default_model_dir)))
    tiny = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)

    def killed(model, folder):
        (folder / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_save_clean_copy", killed)
    with pytest.raises(KeyboardInterrupt):
        loader.convert_gguf_to_hf(loader.default_gguf_path(), target)
    assert not target.exists() and list(target.parent.iterdir()) == []

    monkeypatch.undo()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: transformers.PreTrainedTokenizerFast.from_pretrained(str(default_model_dir)))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    loader.convert_gguf_to_hf(loader.default_gguf_path(), target)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temp dirs left
    reloaded = loader.load_model(EngineConfig(model=str(target), device="cpu"))
    assert torch.equal(reloaded.model.embed_tokens.weight, tiny.model.embed_tokens.weight)


def test_dummy_weights_follow_the_seed(tiny_llama_dir):
    def load(**kwargs):
        return loader.load_model(EngineConfig(model=str(tiny_llama_dir), device="cpu", **kwargs), pack_cpu_linears=False)

    a, b, real = load(load_format="dummy", seed=1), load(load_format="dummy", seed=1), load()
    qkv = "layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(_params(a.model)[qkv], _params(b.model)[qkv])
    assert not torch.equal(_params(a.model)[qkv], _params(real.model)[qkv])
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))


def test_dtype_auto_is_float32_on_cpu_and_explicit_dtype_wins(tiny_llama_dir):
    assert loader.load_model(EngineConfig(model=str(tiny_llama_dir), device="cpu")).dtype == torch.float32
    loaded = loader.load_model(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="bfloat16"))
    assert loaded.dtype == torch.bfloat16 and loaded.model.embed_tokens.weight.dtype == torch.bfloat16


def test_folder_without_weights_and_unknown_architecture_are_refused(tmp_path, default_model_dir):
    from transformers import GPT2Config

    empty = tmp_path / "no-weights"
    empty.mkdir()
    tiny_llama_config().save_pretrained(str(empty))
    copy_tokenizer(default_model_dir, empty)
    with pytest.raises(ValueError, match="no \\*.safetensors or \\*.bin weights .*--load-format dummy"):
        loader.load_model(EngineConfig(model=str(empty), device="cpu"))
    gpt2 = save_random_model(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=49152), tmp_path / "gpt2", default_model_dir)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        loader.load_model(EngineConfig(model=str(gpt2), device="cpu"))
    with pytest.raises(ValueError, match="no such folder or file"):
        loader.load_model(EngineConfig(model=str(tmp_path / "missing"), device="cpu"))


@pytest.mark.parametrize("blocks", [True, False])
def test_native_bf16_advice_names_what_bfloat16_buys_for_the_weights_served(blocks, monkeypatch, caplog):
    # A GGUF's blocks multiply integers whatever the dtype: the advice must not promise them the float linears' 1.5x.
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    with caplog.at_level("INFO", logger=loader.logger.name):
        assert loader.resolve_dtype(EngineConfig(), None, torch.device("cpu"), blocks=blocks) == torch.float32
    advice = [r.getMessage() for r in caplog.records if "bfloat16 natively" in r.getMessage()]
    assert len(advice) == 1
    assert ("about as fast" in advice[0]) == blocks and ("about 1.5x faster" in advice[0]) != blocks


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("small_row_bf16", [True, False])
def test_bfloat16_on_a_cpu_without_native_bf16_warns(native, small_row_bf16, monkeypatch, caplog):
    # The probes read CPUID; every answer is checked here whatever this machine's CPU is. Without native bf16,
    # bfloat16 is still the faster dtype where the small-row kernel serves it (AVX-512): no warning there.
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(loader, "small_rows_available", lambda: small_row_bf16)
    monkeypatch.setattr(loader, "packed_dtypes", lambda: (torch.float32, torch.bfloat16))
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger=loader.logger.name):
        assert loader.resolve_dtype(EngineConfig(dtype="bfloat16"), None, cpu) == torch.bfloat16
        assert loader.resolve_dtype(EngineConfig(dtype="float32"), None, cpu) == torch.float32
        assert loader.resolve_dtype(EngineConfig(dtype="auto"), None, cpu) == torch.float32
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if native or small_row_bf16:
        assert warned == []
    else:
        assert len(warned) == 1 and "--dtype bfloat16" in warned[0] and "float32" in warned[0]
