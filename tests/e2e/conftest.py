"""Fixtures of the end-to-end suite: LLM instances shared per config, HF references, and the block-pool check."""
from __future__ import annotations

import pytest
import torch

from e2e_helpers import MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, ROOMY, assert_all_blocks_free, greedy

# On 2 shared cores OpenMP threads spin against other processes: one thread runs
# both our engine and the HF reference several times faster there.
torch.set_num_threads(1)


_LLMS: dict[tuple, object] = {}


@pytest.fixture(scope="session")
def make_llm(default_model_dir, tiny_llama_dir, tiny_llama_hd64_dir):
    """make_llm("smol" | "tiny" | "tiny64", **config) -> one LLM per distinct config, reused by every test of
    the session ("tiny64": head_dim 64, which the CUDA kernels run)."""
    from engine import LLM

    paths = {"smol": str(default_model_dir), "tiny": str(tiny_llama_dir), "tiny64": str(tiny_llama_hd64_dir)}

    def make(which: str, **overrides):
        kwargs = {**ROOMY, **overrides}
        key = (which, tuple(sorted(kwargs.items())))
        if key not in _LLMS:
            _LLMS[key] = LLM(model=paths[which], **kwargs)
        return _LLMS[key]

    yield make
    _LLMS.clear()


@pytest.fixture(autouse=True)
def every_block_returned():
    """After each test, every engine of the session has all its device and swap blocks back in the pool."""
    yield
    for llm in _LLMS.values():
        assert_all_blocks_free(llm.engine)


@pytest.fixture(scope="session")
def smol_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="session")
def prompt_ids(smol_tokenizer) -> list[list[int]]:
    """PROMPTS through the (shared) tokenizer; the first is one token, the last spans several 16-token blocks."""
    ids = [smol_tokenizer(p).input_ids for p in PROMPTS]
    assert len(ids[0]) == 1 and len(ids[-1]) > 3 * 16
    assert max(len(i) for i in ids) + MAX_TOKENS <= MAX_MODEL_LEN
    assert len({len(i) for i in ids}) == len(ids), "prompts of different lengths"
    return ids


@pytest.fixture(scope="session")
def smol_greedy_outputs(make_llm, prompt_ids):
    """The default model's greedy outputs for prompt_ids with a roomy cache: the reference of several tests."""
    return make_llm("smol").generate(prompt_token_ids=prompt_ids, sampling_params=greedy(), use_tqdm=False)


def _hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_smol(default_model_dir):
    return _hf_model(default_model_dir)


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama_dir):
    return _hf_model(tiny_llama_dir)


@pytest.fixture(scope="session")
def hf_tiny64(tiny_llama_hd64_dir):
    return _hf_model(tiny_llama_hd64_dir)
