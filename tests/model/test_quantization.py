"""int8 weights end to end (issue 42): `--quantization int8` on a float checkpoint, and a GGUF Q8_0 file served as it
is (its blocks never dequantized), on the tiny random Llama with the default tokenizer.

The Q8_0 file is written here as llama.cpp's converter writes one (gguf-py's Q8_0 quantizer, q_proj / k_proj rows
permuted for llama.cpp's RoPE, the default model's tokenizer metadata), so transformers reads its config and
tokenizer, and dequantizes it for the float comparison."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, ops
from engine.config import EngineConfig
from engine.model_executor.layers.quant import dequantize_q8_0, quantize_q8_0
from tiny_models import gguf_reader, write_llama_gguf

pytestmark = pytest.mark.skipif(ops.q8_gemm_isa() == 0, reason="no int8 GEMM path on this CPU")

PROMPTS = ["The capital of France is", "Once upon a time, there", "1, 2, 3, 4,", "def add(a, b):"]


@pytest.fixture(scope="module")
def q8_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    return write_llama_gguf(tiny_llama_dir, tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf")  # every 2-D: Q8_0


def _llm(model, **kwargs) -> LLM:
    return LLM(str(model), max_model_len=128, block_size=16, num_cpu_blocks_override=16, seed=0, **kwargs)


def _greedy(llm: LLM, tokens: int = 24) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _load(**kwargs):
    from engine.model_executor import loader

    return loader.load_model(EngineConfig(device="cpu", **kwargs)).model


def _packed_linears(model) -> dict[str, torch.Tensor]:
    return {n: m._small_weight for n, m in model.named_modules() if getattr(m, "_q8", False)}


def test_quantization_int8_holds_every_linear_in_q8_0_blocks(tiny_llama_dir):
    model = _load(model=str(tiny_llama_dir), quantization="int8")
    packed = _packed_linears(model)
    names = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert set(packed) == names and all(p.dtype == torch.uint8 for p in packed.values())
    assert all(m.weight.numel() == 0 for m in model.modules() if type(m) is torch.nn.Linear)  # floats released


def test_q8_0_gguf_loads_natively_with_the_blocks_int8_quantization_makes(tiny_llama_dir, q8_gguf):
    """The file's blocks, un-permuted, are the ones `--quantization int8` computes from the float weights (gguf-py
    and engine/model_executor/layers/quant.py quantize alike): the same packed bytes, linear for linear, and the same tokens."""
    native = _load(model=str(q8_gguf))
    quantized = _load(model=str(tiny_llama_dir), quantization="int8")
    a, b = _packed_linears(native), _packed_linears(quantized)
    assert set(a) == set(b) and len(a) == 4 * 2 + 1
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ids = torch.tensor([[5, 17, 40000]])
    torch.testing.assert_close(native.embed_tokens(ids), quantized.embed_tokens(ids), rtol=0, atol=0)


def _mapped_files(address: int) -> list[str]:
    """The files /proc/self/maps names for the mappings holding `address` ([] for anonymous memory)."""
    files = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(a, 16) for a in span.split("-"))
        if lo <= address < hi and len(rest) >= 5:
            files.append(rest[4])
    return files


def _mapped_rss_kib(address: int) -> int:
    """The resident KiB of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def test_q8_0_gguf_untied_embedding_is_read_through_a_map_of_the_file(q8_gguf):
    """An untied Q8_0 token embedding stays in the file (a read-only map, as llama.cpp's mmap), not packed into
    anonymous memory: the rows are the file's blocks dequantized, ids out of range are refused, and after a lookup
    none of the map's pages stay resident (the kernel maps cached pages around each row read: the whole file would
    become resident after a few hundred distinct tokens)."""
    model = _load(model=str(q8_gguf))
    emb = model.embed_tokens
    assert _mapped_files(emb._block_rows.data_ptr()) == [str(q8_gguf)]
    t = next(t for t in gguf_reader(q8_gguf).tensors if t.name == "token_embd.weight")
    raw = torch.from_numpy(np.array(t.data)).view(emb.num_embeddings, -1, 34)
    q, d = raw[..., 2:].contiguous().view(torch.int8).flatten(1), raw[..., :2].contiguous().view(torch.float16)[..., 0]
    ids = torch.tensor([[0, 3], [49151, 17]])
    torch.testing.assert_close(emb(ids), dequantize_q8_0(q, d)[ids], rtol=0, atol=0)
    assert _mapped_rss_kib(emb._block_rows.data_ptr()) == 0
    for bad in ([0, -1], [49152]):
        with pytest.raises(IndexError):
            emb(torch.tensor(bad))


def test_gguf_header_reader_gives_gguf_py_tensor_infos(q8_gguf):
    """engine/model_executor/gguf_file.py's own header reader (metadata skipped) gives the architecture and tensor
    infos gguf.GGUFReader gives, on the Q8_0 file and on the default model's Q4_1 one."""
    from engine.model_executor.gguf_file import _Info, _read_header
    from engine.model_executor.loader import default_gguf_path

    for path in (q8_gguf, default_gguf_path()):
        reader = gguf_reader(path)
        field = reader.fields["general.architecture"]
        expected = [_Info(t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)), int(t.data_offset),
                          int(t.n_bytes)) for t in reader.tensors]
        assert _read_header(path) == (bytes(field.parts[field.data[0]]).decode(), expected), path.name


def test_int8_embedding_rows_are_the_dequantized_blocks(tiny_llama_dir):
    from safetensors.torch import load_file

    model = _load(model=str(tiny_llama_dir), quantization="int8")
    w = load_file(str(tiny_llama_dir / "model.safetensors"))["model.embed_tokens.weight"]
    ids = torch.tensor([0, 3, 49151])
    torch.testing.assert_close(model.embed_tokens(ids), dequantize_q8_0(*quantize_q8_0(w[ids])), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_compiled_step_equals_eager_bit_for_bit(tiny_llama_dir, dtype):
    """The compiled step runs the int8 linears through the same kernel as the eager layers: the same tokens and
    logprobs, and it did run (prefill and decode)."""
    runs = []
    for eager in (False, True):
        llm = _llm(tiny_llama_dir, quantization="int8", dtype=dtype, enforce_eager=eager)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                            use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
                     llm.engine.model_runner.model.compiled_plan()))
    (tokens, logprobs, plan), (eager_tokens, eager_logprobs, _) = runs
    assert plan is not None and plan.steps_run >= 12
    assert tokens == eager_tokens and logprobs == eager_logprobs


def test_q8_0_gguf_native_greedy_matches_the_file_dequantized(q8_gguf):
    """Issue 42's bar: greedy outputs of the Q8_0 file served natively equal those of the same file dequantized to
    float32 for at least 95 % of tokens."""
    native = _greedy(_llm(q8_gguf, dtype="float32"))
    dequantized = _greedy(_llm(q8_gguf, dtype="float32", quantization="none"))
    same = sum(x == y for a, b in zip(native, dequantized) for x, y in zip(a, b))
    assert same >= 0.95 * sum(len(a) for a in dequantized), (native, dequantized)


def test_quantization_is_refused_where_it_cannot_run(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=str(tiny_llama_dir), quantization="int4")


def test_default_model_stays_float(tiny_llama_dir):
    model = _load(model=str(tiny_llama_dir))
    assert not _packed_linears(model)


def test_cli_quantization_flag_reaches_the_engine_config():
    from server.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["serve", "--quantization", "int8"])).quantization == "int8"
    assert config_from_args(build_parser().parse_args(["serve"])).quantization is None


def test_int8_head_writes_float32_logits_directly():
    """A bfloat16 model's int8 head writes its logits in float32 (not rounded to bfloat16 and widened)."""
    from engine.model_executor.layers.cpu_linear import forward_float32
    from engine.model_executor.layers.quant import attach_q8_linear, pack_q8

    head = torch.nn.Linear(64, 100, bias=False, dtype=torch.bfloat16)
    attach_q8_linear(head, pack_q8(*quantize_q8_0(torch.randn(100, 64))))
    x = torch.randn(3, 64).bfloat16()
    logits = forward_float32(head, x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, ops.q8_gemm(torch.empty(3, 100), x, head._small_weight, None))
    assert not torch.equal(logits, logits.bfloat16().float())
