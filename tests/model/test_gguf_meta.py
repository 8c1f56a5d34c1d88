"""A GGUF's config from its metadata and its tokenizer from the conversion kept in the cache (issue 42: a served
GGUF's memory): the same as transformers gives from the file, and a second start imports none of its config classes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.model_executor import loader
from engine.model_executor.gguf_meta import gguf_config, gguf_tokenizer
from engine.model_executor.models import get_model_class
from engine.model_executor.models.llama import rope_inv_freq
from engine.model_executor.models.llama_args import ModelArgs
from engine.worker.cache_engine import kv_shape

REPO = Path(__file__).resolve().parents[2]
# Every field of an HF config the engine and the server read (engine/, server/: hf_config.<field>).
FIELDS = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "attention_bias",
          "mlp_bias", "tie_word_embeddings", "max_position_embeddings", "rope_parameters", "sliding_window",
          "use_sliding_window", "bos_token_id", "eos_token_id", "pad_token_id", "dtype")
TEXTS = ["Hello world", "hello the world", "  two spaces,\ttab\n\nnewlines", "héllo wörld 🤖 中文 ",
         "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>after", "def f(x):\n    return x ** 2\n", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And <|im_end|> 3+3?"}]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "l l", "he ll", "hell o"]
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: each byte as the printable character byte-level BPE vocabularies spell it with."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes keep their own code point
    return [chr(c) for c in cs]


def write_gguf(out: Path, arch: str = "llama", name: str = "tiny", untied: bool = False, add_bos: bool = True,
               **keys) -> Path:
    """A small GGUF as llama.cpp's converter lays one out: the model's keys (keys override them, None drops one),
    a byte-level BPE tokenizer of a few hundred tokens with ChatML specials, and token_embd (+ output) tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name)
    fields = {"block_count": 2, "context_length": 512, "embedding_length": 64, "feed_forward_length": 128,
              "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 500000.0,
              "attention.layer_norm_rms_epsilon": 1e-5, "rope.dimension_count": 16, **keys}
    for key, value in fields.items():
        if value is not None:
            kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
            writer.add_key_value(f"{arch}.{key}", value, kind)
    tokens = SPECIALS + _byte_chars() + [m.replace(" ", "") for m in MERGES]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    if untied:
        writer.add_tensor("output.weight", np.zeros((len(tokens), 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def _engine_view(c) -> dict:
    """The config fields the engine reads, and what it builds from them."""
    args = ModelArgs.from_hf(c)
    inv_freq, scale = rope_inv_freq(c, args.head_dim, 64)
    return {**{f: getattr(c, f, None) for f in FIELDS}, "args": args, "class": get_model_class(c),
            "max_len": loader.model_max_len(c), "kv_shape": kv_shape(c), "rope": (inv_freq.tolist(), scale)}


GGUFS = {  # name -> write_gguf's arguments
    "llama": {},
    "llama-untied-padded-vocab": dict(untied=True, vocab_size=320),
    "llama-defaults": dict(**{"attention.head_count_kv": None, "rope.freq_base": None, "context_length": None,
                              "rope.dimension_count": None}),
    "qwen2": dict(arch="qwen2", untied=True),
    "mistral": dict(name="mistral"),
}


@pytest.mark.parametrize("name", ["smollm2", *GGUFS])
def test_gguf_config_reads_what_transformers_reads(name, tmp_path):
    if name == "smollm2":
        path = loader.default_gguf_path()
    else:
        path = write_gguf(tmp_path / f"{name}.gguf", **GGUFS[name])
    ours, hf = gguf_config(path), _hf_config(path)
    assert _engine_view(ours) == _engine_view(hf)


def test_a_gguf_of_another_architecture_gets_transformers_config(tmp_path):
    path = write_gguf(tmp_path / "stablelm.gguf", arch="stablelm")  # a family pagedserve does not map
    assert gguf_config(path) is None


def assert_same_tokenizer(ref, tok) -> None:
    """Encodes, decodes and renders the chat template as ref does."""
    for text in TEXTS:
        for special in (True, False):
            ids = ref(text, add_special_tokens=special).input_ids
            assert tok(text, add_special_tokens=special).input_ids == ids, (text, special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for prompt in (True, False):
        assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt) == \
            ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "chat_template"):
        assert getattr(tok, attr) == getattr(ref, attr), attr
    assert len(tok) == len(ref)
    assert {i: str(t) for i, t in tok.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in ref.added_tokens_decoder.items()}


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> dict:
    """name -> (the GGUF, AutoTokenizer's tokenizer of it, the tokenizer a later start loads from the cache), with
    the entries kept under one cache folder."""
    cache = tmp_path_factory.mktemp("cache")
    files = {"smollm2": loader.default_gguf_path(),
             "add-bos": write_gguf(tmp_path_factory.mktemp("gguf") / "add-bos.gguf", add_bos=True)}
    out = {}
    for name, path in files.items():
        ref = gguf_tokenizer(path, cache)  # converted by transformers, kept
        with pytest.MonkeyPatch.context() as mp:
            import transformers

            mp.setattr(transformers.AutoTokenizer, "from_pretrained", _no_conversion)
            out[name] = (path, ref, gguf_tokenizer(path, cache))
    out["cache"] = cache
    return out


def _no_conversion(*args, **kwargs):
    raise AssertionError("the tokenizer was converted again instead of read from the cache")


@pytest.mark.parametrize("name", ["smollm2", "add-bos"])
def test_the_kept_tokenizer_is_the_one_transformers_converts(kept, name):
    path, ref, tok = kept[name]
    assert tok is not ref
    assert_same_tokenizer(ref, tok)
    if name == "add-bos":
        assert tok("hello").input_ids[0] == tok.bos_token_id == 1


def test_second_start_imports_no_sympy_and_holds_less_memory(kept):
    """The config and the kept tokenizer of a second start, then the model built, in a fresh process: sympy and
    torch.distributed.tensor (~100 MiB a server held for its life) never imported; the config and tokenizer's peak
    memory over `import torch` is ~85 MiB where transformers' GGUF config and tokenizer took ~250 MiB (SmolLM2)."""
    path, ref, _ = kept["smollm2"]
    code = f"""
import json, sys
def kib(key): return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
import torch
base = kib("VmRSS")
from engine.config import EngineConfig
from engine.model_executor import loader
source = loader._source(EngineConfig(model={str(path)!r}, device="cpu"))
tok = loader.load_tokenizer(source)
peak_mib = (kib("VmHWM") - base) / 1024
loaded = loader.load_model(EngineConfig(model={str(path)!r}, device="cpu", load_format="dummy", dtype="bfloat16"))
print(json.dumps({{"sympy": [m for m in ("sympy", "torch.distributed.tensor") if m in sys.modules],
                  "peak_mib": peak_mib, "vocab": source.hf_config.vocab_size, "ids": tok({TEXTS[4]!r}).input_ids}}))
"""
    # The fresh cache gets this process's kernel build (a link): the subprocess measures a start, not a 5-minute
    # build of every kernel on a busy 2-core machine.
    from engine.ops.build import load

    built = Path(load().__file__).parent
    link = Path(kept["cache"]) / built.name
    if not link.exists():
        link.symlink_to(built, target_is_directory=True)
    env = {**os.environ, "PAGEDSERVE_CACHE": str(kept["cache"])}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ids"] == ref(TEXTS[4]).input_ids and got["vocab"] == 49152
    assert got["sympy"] == [], got
    assert got["peak_mib"] < 150, got


def test_an_unwritable_cache_still_gives_the_tokenizer(tmp_path, caplog):
    path = write_gguf(tmp_path / "tiny.gguf")
    blocked = tmp_path / "a-file"  # a cache folder that cannot be made (as root, a read-only mode would not stop it)
    blocked.write_text("")
    from transformers import AutoTokenizer

    tok = gguf_tokenizer(path, blocked)
    assert "every start converts it again" in caplog.text
    assert_same_tokenizer(AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name), tok)


def test_a_damaged_or_stale_entry_is_converted_again(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    ref = gguf_tokenizer(path, cache)
    (entry,) = (cache / "gguf-tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{")
    assert_same_tokenizer(ref, gguf_tokenizer(path, cache))  # converted again, and kept whole
    assert json.loads((entry / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    write_gguf(path, add_bos=False)  # the same path, another file: its own tokenizer, not the kept one
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    tok = gguf_tokenizer(path, cache)
    assert tok("hello").input_ids[0] != 1 and tok("hello").input_ids == gguf_tokenizer(path, cache)("hello").input_ids
    path.unlink()
    write_gguf(tmp_path / "other.gguf")
    gguf_tokenizer(tmp_path / "other.gguf", cache)
    assert len(list((cache / "gguf-tokenizers").iterdir())) == 1  # the vanished file's entry went
