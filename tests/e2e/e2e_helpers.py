"""Prompts, sampling settings and checks shared by the end-to-end tests."""
from __future__ import annotations

from typing import Optional

import torch

from engine.sampling_params import SamplingParams

MAX_TOKENS = 16
# Just above the longest prompt plus MAX_TOKENS: a pressured cache can hold little more than one sequence.
MAX_MODEL_LEN = 80
# What every e2e engine gets unless a test asks otherwise: a roomy pool, so nothing is preempted, and
# float32, the dtype of the HF references (and of dtype auto on CPU).
ROOMY = dict(num_gpu_blocks_override=512, num_cpu_blocks_override=64, block_size=16, max_model_len=MAX_MODEL_LEN,
             dtype="float32")

# Real text of different lengths; the first is a single token, the last crosses several 16-token blocks.
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colours of the rainbow:",
    "Water boils at a temperature of",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    (
        "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
        "energy into chemical energy. During this process, carbon dioxide and water are turned into "
        "glucose and oxygen, using the energy of sunlight captured by chlorophyll. In summary, the two "
        "products of photosynthesis are"
    ),
]


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def seeded_pair(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    """n=2 samples at temperature 0.8 with a fixed seed: reproducible whatever else is in the batch."""
    return SamplingParams(n=2, temperature=0.8, seed=1234, max_tokens=max_tokens, **kw)


def token_ids(outputs) -> list[list[list[int]]]:
    """Per request, the token ids of each completion in order."""
    return [[c.token_ids for c in out.outputs] for out in outputs]


def assert_all_blocks_free(engine) -> None:
    """Nothing left running, every device block back in the pool, no swap block in use."""
    assert not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
    assert not bm.block_tables and not bm.cpu_block_tables


def blocks_for(num_tokens: int, block_size: int = 16) -> int:
    return -(-num_tokens // block_size)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: Optional[int]) -> list[int]:
    """HF transformers' greedy generate for one prompt, no padding; eos None generates all max_new_tokens."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0,
    )
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:  # [len(token_ids), vocab]
    """log_softmax of HF's logits; row i is the distribution of token i + 1."""
    logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
