"""A mixed GGUF served as its blocks (issue 53): a tiny random Llama written as llama.cpp's Q4_K_M lays one out
(Q4_K for most linears, Q6_K for attn_v and the head, Q8_0 / Q5_0 for ffn_down whose 288-wide rows are not whole
256-blocks, F32 norms) plus a Q3_K tensor (no kernel here: dequantized with a warning) and a Q4_1 one; and
`--quantization q4_k` / `q4_0` on the float checkpoint.

The comparison is the file against itself: transformers dequantizes the same file (`--quantization none`), and at
>= 95 % of the positions of its greedy continuations the native model's top token is the dequantized model's greedy
token (teacher-forced: the kernels quantize activations to int8 per block, and this random model's logits are
nearly flat, top-two gaps of ~0.005 in logprob; one flipped near-tie would otherwise change every later token)."""
from __future__ import annotations

import functools
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_executor.layers import formats
from tiny_models import gguf_reader, save_random_model, tiny_llama_hd64_config, write_llama_gguf

pytestmark = pytest.mark.skipif(not formats.get_format("Q8_0").native(), reason="no int8 kernels on this CPU")

PROMPTS = ["The capital of France is", "Once upon a time, there", "1, 2, 3, 4,", "def add(a, b):"]
ROOT = Path(__file__).resolve().parents[2]


def q4_k_m_type(name: str, shape) -> str:
    """llama.cpp's Q4_K_M choice for a tensor of this tiny model, plus two types to exercise: blk.1.attn_output
    Q3_K (no kernel), blk.0.ffn_up Q4_1."""
    if name == "blk.1.attn_output.weight":
        return "Q3_K"
    if name == "blk.0.ffn_up.weight":
        return "Q4_1"
    if name in ("output.weight", "token_embd.weight") and "tied" in name:
        return "Q6_K"
    want = "Q6_K" if name == "output.weight" or ".attn_v." in name or name == "blk.0.ffn_down.weight" else "Q4_K"
    if shape[1] % 256:  # llama-quant.cpp's fallback for rows that are not whole super-blocks
        return {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[want]
    return want


EXPECTED = {  # the formats each linear's parts hold, in output order
    "layers.0.self_attn.qkv_proj": ["Q4_K", "Q4_K", "Q6_K"], "layers.1.self_attn.o_proj": ["Q8_0"],
    "layers.0.self_attn.o_proj": ["Q4_K"], "layers.0.mlp.gate_up_proj": ["Q4_K", "Q4_1"],
    "layers.1.mlp.gate_up_proj": ["Q4_K", "Q4_K"], "layers.0.mlp.down_proj": ["Q8_0"],
    "layers.1.mlp.down_proj": ["Q5_0"], "lm_head": ["Q6_K"],
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, default_model_dir) -> Path:
    """hidden 256 (whole Q4_K blocks), MLP 288 (ffn_down's rows fall back to 32-blocks), GQA 4 / 2 heads of 64."""
    return save_random_model(tiny_llama_hd64_config(intermediate_size=288), tmp_path_factory.mktemp("kq-hf"),
                             default_model_dir, seed=3)


@pytest.fixture(scope="module")
def mixed_gguf(hf_dir, tmp_path_factory) -> Path:
    return write_llama_gguf(hf_dir, tmp_path_factory.mktemp("kq") / "tiny-Q4_K_M.gguf", q4_k_m_type, file_type=15)


def _load(**kwargs):
    from engine.model_executor import loader

    return loader.load_model(EngineConfig(device="cpu", **kwargs)).model


def _llm(model, **kwargs) -> LLM:
    return LLM(str(model), max_model_len=128, block_size=16, num_cpu_blocks_override=16, seed=0, **kwargs)


def _agree(llm: LLM, reference: LLM, tokens: int = 24) -> float:
    """The share of the reference's greedy tokens (after each prompt) that are llm's top token at that position,
    given the same prefix (prompt_logprobs over prompt + the reference's continuation)."""
    tok = reference.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = reference.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    scored = llm.generate(prompt_token_ids=full, sampling_params=SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    same = [max(o.prompt_logprobs[i], key=o.prompt_logprobs[i].get) == ids[i]
            for p, ids, o in zip(prompts, full, scored) for i in range(len(p), len(ids))]
    return sum(same) / len(same)


@functools.lru_cache(maxsize=2)
def _file_tensors(path: Path) -> dict:
    """gguf-py's tensors of a file by name: one reader a file (each parses the 49k-token vocabulary, ~9 s)."""
    return {t.name: t for t in gguf_reader(path).tensors}


def _file_weight(path: Path, gguf_name: str, heads: int = 0) -> torch.Tensor:
    """A tensor of the file dequantized by gguf-py (rows un-permuted for q / k): the float reference."""
    import gguf

    t = _file_tensors(path)[gguf_name]
    w = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).copy()).float()
    if heads:
        from engine.model_executor.gguf_file import unpermute_rows

        w = w[unpermute_rows(w.shape[0], heads)]
    return w


def test_mixed_file_holds_each_tensor_in_its_own_format(mixed_gguf, caplog):
    """Every linear takes the file's blocks in the file's types (fused parts differing), the Q3_K tensor is held
    as Q8_0 with a warning naming Q3_K, no linear or embedding keeps a float weight, and each linear computes
    x @ W.T of the file's weights dequantized (within the activation quantization's error)."""
    with caplog.at_level(logging.WARNING):
        model = _load(model=str(mixed_gguf))
    for name, kinds in EXPECTED.items():
        parts = formats.format_of(model.get_submodule(name))
        assert parts is not None and [f.name for f, _ in parts] == kinds, (name, parts)
    assert any("Q3_K" in r.getMessage() and "blk.1.attn_output" in r.getMessage() for r in caplog.records)
    assert all(m.weight.numel() == 0 for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    refs = {"layers.0.self_attn.qkv_proj": torch.cat([_file_weight(mixed_gguf, "blk.0.attn_q.weight", 4),
                                                      _file_weight(mixed_gguf, "blk.0.attn_k.weight", 2),
                                                      _file_weight(mixed_gguf, "blk.0.attn_v.weight")]),
            "layers.0.mlp.gate_up_proj": torch.cat([_file_weight(mixed_gguf, "blk.0.ffn_gate.weight"),
                                                    _file_weight(mixed_gguf, "blk.0.ffn_up.weight")]),
            "layers.1.self_attn.o_proj": _file_weight(mixed_gguf, "blk.1.attn_output.weight"),
            "lm_head": _file_weight(mixed_gguf, "output.weight")}
    for name, w in refs.items():
        got, want = model.get_submodule(name)(x), x @ w.T
        assert (got - want).abs().max() <= 0.03 * want.abs().max(), name


def test_mixed_file_embedding_gathers_dequantized_rows_from_a_map(mixed_gguf):
    """token_embd (Q4_K) stays in a read-only map of the file; a lookup dequantizes only its rows (equal to
    gguf-py's dequantization of them) and leaves none of the map's pages resident."""
    from test_quantization import _mapped_files, _mapped_rss_kib

    model = _load(model=str(mixed_gguf))
    emb = model.embed_tokens
    assert _mapped_files(emb._block_rows.data_ptr()) == [str(mixed_gguf)]
    ids = torch.tensor([[0, 3], [49151, 17]])
    want = _file_weight(mixed_gguf, "token_embd.weight")[ids]
    torch.testing.assert_close(emb(ids), want, rtol=0, atol=0)
    assert _mapped_rss_kib(emb._block_rows.data_ptr()) == 0
    with pytest.raises(IndexError):
        emb(torch.tensor([49152]))


def test_mixed_file_greedy_matches_the_file_dequantized(mixed_gguf):
    agree = _agree(_llm(mixed_gguf, dtype="float32"), _llm(mixed_gguf, dtype="float32", quantization="none"))
    assert agree >= 0.95, agree


def test_tied_file_head_reads_token_embd(hf_dir, tmp_path):
    """A file without output.weight (tied): the head takes token_embd's Q6_K blocks, the embedding maps them."""
    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied-hf"
    tied.mkdir()
    for f in hf_dir.iterdir():
        (tied / f.name).write_bytes(f.read_bytes())
    state = load_file(str(hf_dir / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tied / "model.safetensors"))
    cfg = (tied / "config.json").read_text().replace('"tie_word_embeddings": false', '"tie_word_embeddings": true')
    (tied / "config.json").write_text(cfg)
    path = write_llama_gguf(tied, tmp_path / "tied.gguf",
                            lambda n, s: "Q6_K" if n == "token_embd.weight" else q4_k_m_type(n, s), file_type=15)
    model = _load(model=str(path))
    assert [f.name for f, _ in formats.format_of(model.lm_head)] == ["Q6_K"]
    x = torch.randn(3, 256)
    w = _file_weight(path, "token_embd.weight")
    want = x @ w.T
    assert (model.lm_head(x) - want).abs().max() <= 0.03 * want.abs().max()
    torch.testing.assert_close(model.embed_tokens(torch.tensor([7])), w[7:8], rtol=0, atol=0)


@pytest.mark.parametrize("quantization, kinds", [("q4_k", {"Q4_K", "Q5_0"}), ("q4_0", {"Q4_0"})])
def test_quantization_flag_quantizes_a_float_checkpoint(hf_dir, tmp_path, quantization, kinds):
    """`--quantization q4_k` / `q4_0` on the float checkpoint: every linear in that type (Q4_K's fallback Q5_0 for
    the 288-wide down_proj rows), the embedding too; its top tokens are the greedy tokens of the float model whose
    weights are the same blocks dequantized (written here as a float folder)."""
    from safetensors.torch import load_file, save_file

    from engine.model_executor.layers.ggml_quantize import fallback_type, quantize_rows

    model = _load(model=str(hf_dir), quantization=quantization)
    held = {f.name for m in model.modules() if type(m) is torch.nn.Linear for f, _ in formats.format_of(m)}
    assert held == kinds
    deq = tmp_path / "dequantized"
    deq.mkdir()
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            (deq / f.name).write_bytes(f.read_bytes())
    want = {"q4_k": "Q4_K", "q4_0": "Q4_0"}[quantization]
    state = {}
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        if w.dim() == 2:
            kind = fallback_type(want, w.shape[1])
            w = formats.get_format(kind).dequantize(quantize_rows(w, kind))
        state[name] = w.contiguous()
    save_file(state, str(deq / "model.safetensors"))
    agree = _agree(_llm(hf_dir, dtype="float32", quantization=quantization), _llm(deq, dtype="float32"))
    assert agree >= 0.95, agree


def test_large_linears_pack_a_chunk_of_rows_at_a_time(mixed_gguf, monkeypatch):
    """A linear larger than formats.PACK_CHUNK_BYTES (but q / k, whose rows are permuted) is read from the file a
    chunk of rows at a time as it is packed (gguf_file.FileRows), so the load holds one chunk of its file bytes:
    with the chunk shrunk to 2 KiB every such linear here packs in several chunks, and every linear multiplies
    exactly as the whole-tensor load's."""
    from engine.model_executor import gguf_file

    whole = _load(model=str(mixed_gguf))
    reads = []
    getitem = gguf_file.FileRows.__getitem__
    monkeypatch.setattr(gguf_file.FileRows, "__getitem__",
                        lambda self, rows: reads.append(self.info.name) or getitem(self, rows))
    monkeypatch.setattr(formats, "PACK_CHUNK_BYTES", 2048)
    chunked = _load(model=str(mixed_gguf))
    assert "output.weight" in reads and "blk.0.ffn_down.weight" in reads
    assert not any(".attn_q." in r or ".attn_k." in r for r in reads)
    assert all(reads.count(name) > 1 for name in set(reads))  # several chunks each
    gen = torch.Generator().manual_seed(2)
    for name, m in whole.named_modules():
        if isinstance(m, torch.nn.Linear):
            x = torch.randn(3, m.in_features, generator=gen)
            assert torch.equal(chunked.get_submodule(name)(x), m(x)), name


_PEAK = """
import sys, resource
from engine.config import EngineConfig
from engine.model_executor import loader
def kib(key):
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key))
config = EngineConfig(model=sys.argv[1], device='cpu', quantization=sys.argv[2] if len(sys.argv) > 2 else None)
loader._source(config)  # the config and the modules the load needs, before the peak is read
before = kib('VmHWM:')
loaded = loader.load_model(config)
print(kib('VmHWM:') - before, kib('VmRSS:'))
"""


def test_mixed_file_load_peak_stays_near_its_blocks(mixed_gguf):
    """Peak memory (/proc VmHWM) of the native load against the same file dequantized by transformers: the native
    load's growth stays under twice the file's size plus 64 MiB (the tokenizer, the runtime's arenas), and well
    under the dequantized load's (a float32 copy is ~7x the blocks). Generous: allocators differ by machine."""
    def peak(*args: str) -> int:
        out = subprocess.run([sys.executable, "-c", _PEAK, str(mixed_gguf), *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=300, check=True)
        return int(out.stdout.split()[-2])

    size_kib = mixed_gguf.stat().st_size // 1024
    native, dequantized = peak(), peak("none")
    assert native < 2 * size_kib + 64 * 1024, (native, size_kib)
    assert native < dequantized, (native, dequantized)
