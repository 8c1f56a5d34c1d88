"""A CPU decode batch split across the cores (one shard per core, one OpenMP thread each) gives the tokens and
logprobs of one forward over the whole batch, and leaves the step thread's OpenMP setting as it was."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, ops
from engine.worker.model_runner import SPLIT_MIN_ROWS, SPLIT_MIN_ROWS_BF16
from engine.sampling_params import SamplingParams
from tests.kernels.conftest import torch_threads  # the e2e conftest sets 1 thread for the session

pytestmark = pytest.mark.skipif(ops.backend() is not ops.OpsBackend.COMPILED_CPU, reason="needs the compiled CPU ops")

NUM_PROMPTS = 2 * SPLIT_MIN_ROWS + 3  # two shards, of 17 and 18 sequences


def _prompts(tokenizer, num: int = NUM_PROMPTS) -> list[list[int]]:
    topics = ["the sea", "a red fox", "prime numbers", "Paris in spring", "how bread rises", "the moon",
              "a chess opening", "rain on a roof", "old maps", "the speed of light"]
    texts = [f"Write one sentence about {topics[i % len(topics)]}, take {i}." for i in range(num)]
    return [tokenizer(t)["input_ids"] for t in texts]


def test_split_decode_matches_one_forward(default_model_dir):
    with torch_threads(2):
        llm = LLM(model=str(default_model_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=256,
                  num_cpu_blocks_override=16, block_size=16, seed=0)
        runner = llm.engine.model_runner
        assert runner._split, "2 threads, compiled ops: decode batches are split"
        split_calls = []
        original = runner._split_decode

        def counted(inp, kv_caches, shards, *args):
            split_calls.append((inp.meta.num_decode_tokens, shards))
            return original(inp, kv_caches, shards, *args)

        runner._split_decode = counted
        prompts = _prompts(llm.get_tokenizer())
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
        split = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert torch.get_num_threads() == 2, "the step thread's OpenMP threads are restored after a split step"
        runner._split = False
        whole = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    assert split_calls and all(shards == 2 for _, shards in split_calls)
    assert split_calls[0][0] == NUM_PROMPTS  # every sequence decoding at once
    for a, b in zip(split, whole):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            for token, value in lp_a.items():
                assert value == pytest.approx(lp_b[token], abs=1e-3)
    stats = llm.engine.get_stats()
    assert stats.num_running == 0 and stats.device_cache_usage == 0.0  # every block back in the pool


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_greedy_batch_without_logits_matches_the_logits(default_model_dir, dtype):
    """A steady greedy decode without top logprobs asks the head for argmax and logsumexp only
    (LlamaForCausalLM.compute_greedy: the logits are never written): the tokens and the cumulative logprobs equal
    those of the same steps with the head writing its logits (serves_greedy off), for a batch split across the cores
    and a small one, and the stats path did serve steps (where the small-row kernel holds the head: every row count
    in float32; bfloat16 up to SMALL_ROWS on a CPU where oneDNN's AMX GEMM takes the larger ones)."""
    with torch_threads(2):
        llm = LLM(model=str(default_model_dir), dtype=dtype, max_model_len=256, num_gpu_blocks_override=256,
                  num_cpu_blocks_override=16, block_size=16, seed=0)
        model = llm.engine.model_runner.model
        served, original = [], model.compute_greedy

        def counted(hidden):
            stats = original(hidden)
            served.append(stats is not None)
            return stats

        model.compute_greedy = counted
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for num in (2 * SPLIT_MIN_ROWS_BF16 + 2, 5):  # split in either dtype; one forward
            prompts = _prompts(llm.get_tokenizer(), num)
            stats = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            serves, model.serves_greedy = model.serves_greedy, lambda *a: False
            logits = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            model.serves_greedy = serves
            for a, b in zip(stats, logits):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)
    assert any(served), "the head served the greedy steps' stats"
    stats = llm.engine.get_stats()
    assert stats.num_running == 0 and stats.device_cache_usage == 0.0


def _split_counting_llm(model_dir, dtype: str, num_blocks: int) -> tuple[LLM, list[int]]:
    """An LLM on 2 threads whose runner records each split step's decode batch size."""
    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=256, num_gpu_blocks_override=num_blocks,
              num_cpu_blocks_override=16, block_size=16, seed=0)
    runner, calls = llm.engine.model_runner, []
    original = runner._split_decode
    runner._split_decode = lambda inp, *a: calls.append(inp.meta.num_decode_tokens) or original(inp, *a)
    return llm, calls


def test_small_batches_and_prefills_are_not_split(default_model_dir):
    with torch_threads(2):
        llm, calls = _split_counting_llm(default_model_dir, "float32", 64)
        prompts = _prompts(llm.get_tokenizer())[: 2 * SPLIT_MIN_ROWS - 1]
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)
    assert calls == []  # 31 sequences: one shard of 15 would be too small


def test_bfloat16_splits_only_from_its_own_larger_batch(default_model_dir):
    # Each shard reads every weight: bfloat16's cheaper multiply-adds make that pay only from 40 sequences.
    with torch_threads(2):
        llm, calls = _split_counting_llm(default_model_dir, "bfloat16", 128)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        prompts = _prompts(llm.get_tokenizer(), 2 * SPLIT_MIN_ROWS_BF16)
        llm.generate(prompt_token_ids=prompts[: 2 * SPLIT_MIN_ROWS], sampling_params=params, use_tqdm=False)
        assert calls == []  # 32 sequences: float32 would split them
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert calls and set(calls) == {2 * SPLIT_MIN_ROWS_BF16}
