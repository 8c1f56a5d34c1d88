"""Tensor parallelism on CPU (gloo, two spawned ranks): the tokens of one rank, whatever the sampling, under
preemption by swap and with prefix caching."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

from e2e_helpers import MAX_MODEL_LEN, ROOMY, assert_all_blocks_free, blocks_for, greedy, seeded_pair, token_ids
from engine.sampling_params import SamplingParams

# Room for two sequences at full length: the mixed batch below is preempted by swap, and the shared prefix of
# its prompts is cached.
PRESSURED = dict(ROOMY, num_gpu_blocks_override=2 * blocks_for(MAX_MODEL_LEN) + 1, preemption_mode="swap",
                 enable_prefix_caching=True)
MAX_TOKENS = 12
ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def llms(tiny_llama_dir):
    """The tiny Llama (4 heads, 2 key/value heads) on one rank and on two, same config (one tensor-parallel
    engine per process: torch holds one default process group)."""
    from engine import LLM

    made = {}
    try:
        for size in (1, 2):
            made[size] = LLM(model=str(tiny_llama_dir), tensor_parallel_size=size, **PRESSURED)
        yield made
    finally:
        for llm in made.values():
            llm.shutdown()


def _requests(prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Every prompt greedy with logprobs, seeded n=2, and beam search; half of them behind a shared prefix."""
    shared = prompt_ids[-1][:40]  # 2.5 blocks that several prompts start with: the prefix cache serves them
    prompts, params = [], []
    for i, ids in enumerate(prompt_ids):
        prompt = shared + ids if i % 2 else ids
        prompt = prompt[: MAX_MODEL_LEN - MAX_TOKENS]
        prompts += [prompt, prompt, prompt]
        params += [greedy(MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=1),
                   seeded_pair(MAX_TOKENS, ignore_eos=True),
                   SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS)]
    return prompts, params


def _logprobs(output) -> list[float]:
    """The sampled token's logprob at each step of the first completion, then the prompt's."""
    c = output.outputs[0]
    sampled = [step[token] for step, token in zip(c.logprobs, c.token_ids)]
    prompt = [next(iter(d.values())) for d in (output.prompt_logprobs or []) if d]
    return sampled + prompt


def test_two_ranks_give_the_tokens_of_one(llms, prompt_ids):
    prompts, params = _requests(prompt_ids)
    outputs = {}
    for size, llm in llms.items():
        before = llm.engine.get_stats()
        outputs[size] = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = llm.engine.get_stats()
        assert stats.num_preemptions_swap > before.num_preemptions_swap, f"TP={size} never swapped"
        assert stats.prefix_cache_hit_rate > 0, f"TP={size}: no prefix cache hit"
        assert all(o.error is None for o in outputs[size])
        assert_all_blocks_free(llm.engine)

    one, two = outputs[1], outputs[2]
    assert token_ids(two) == token_ids(one)
    assert [[c.finish_reason for c in o.outputs] for o in two] == [[c.finish_reason for c in o.outputs] for o in one]
    for a, b in zip(one, two):
        if a.outputs[0].logprobs:  # greedy: sampled and prompt logprobs within 1e-3 (float32)
            assert max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b))) < 1e-3
        assert all(abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-3 for x, y in zip(a.outputs, b.outputs))


def test_four_ranks_replicate_the_two_key_value_heads(make_llm, tiny_llama_dir, prompt_ids):
    """N = 4 > 2 key/value heads: each rank holds the one its query heads read (vLLM's rule)."""
    from engine import LLM

    llm = LLM(model=str(tiny_llama_dir), tensor_parallel_size=4, **ROOMY)
    try:
        params = greedy(MAX_TOKENS, ignore_eos=True, logprobs=1)
        four = llm.generate(prompt_token_ids=prompt_ids[:4], sampling_params=params, use_tqdm=False)
        one = make_llm("tiny").generate(prompt_token_ids=prompt_ids[:4], sampling_params=params, use_tqdm=False)
        assert token_ids(four) == token_ids(one)
        assert max(abs(x - y) for a, b in zip(one, four) for x, y in zip(_logprobs(a), _logprobs(b))) < 1e-3
        assert llm.engine.cache_engine.block_shape[0] == 1  # one key/value head per rank
    finally:
        llm.shutdown()


def test_one_tensor_parallel_engine_per_process_taking_the_ranks_thread_share(tiny_llama_dir):
    """A second tensor-parallel engine in the process is refused (torch holds one default group) and the first
    serves on. torch's thread count is process-wide: rank 0 takes its share of the cores while it runs, then gives
    the process its own count back. (One engine for both checks: each start spawns a rank, seconds on 2 cores.)"""
    from engine import LLM
    from engine.distributed.group import StartupError, cpu_threads_per_rank

    share, before = cpu_threads_per_rank(2), torch.get_num_threads()
    torch.set_num_threads(share + 2)
    try:
        first = LLM(model=str(tiny_llama_dir), tensor_parallel_size=2, **ROOMY)
        try:
            assert torch.get_num_threads() == share
            with pytest.raises(StartupError, match="already holds a tensor-parallel group"):
                LLM(model=str(tiny_llama_dir), tensor_parallel_size=2, **ROOMY)
            out = first.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=greedy(4), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4  # the first engine's group is untouched
        finally:
            first.shutdown()
        assert torch.get_num_threads() == share + 2
    finally:
        torch.set_num_threads(before)


def test_a_dead_engines_shutdown_waits_for_the_step_in_flight(tiny_llama_dir):
    """A rank dies while rank 0's step thread is inside a step: the shutdown tears the group down only after that
    step is over (destroying it under a step still in a collective is undefined behaviour)."""
    import asyncio
    import threading

    import torch.distributed as dist
    from engine.frontend.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig

    in_step, release, group_alive_at_step_end = threading.Event(), threading.Event(), []

    def hold_the_step(stage: str, request_ids: list[str]) -> None:
        if stage == "forward":
            in_step.set()
            release.wait(60)
            group_alive_at_step_end.append(dist.is_initialized())
            raise RuntimeError("this step ends here")  # no collective on a group that may be gone

    async def run() -> None:
        engine = AsyncLLMEngine.from_config(EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=2, **ROOMY),
                                            log_stats=False)
        engine.engine.fault_injector = hold_the_step
        reader = asyncio.ensure_future(engine.generate("r", prompt_token_ids=[1, 2, 3], params=greedy(4)).__anext__())
        assert await asyncio.to_thread(in_step.wait, 60)
        engine.engine.workers.processes[0].kill()
        for _ in range(600):  # the watcher thread sees the rank's exit: the engine is dead
            if engine.errored:
                break
            await asyncio.sleep(0.05)
        assert engine.errored
        threading.Timer(1.0, release.set).start()
        await engine.shutdown()
        assert group_alive_at_step_end == [True], "the group was torn down under the running step"
        assert not dist.is_initialized()
        reader.cancel()

    try:
        asyncio.run(run())
    finally:
        release.set()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_size_that_does_not_divide_the_heads_is_refused(tiny_llama_dir):
    from engine import LLM

    with pytest.raises(ValueError, match=r"tensor-parallel-size 3 must divide .*num_attention_heads \(4\)"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=3, **ROOMY)



NCCL_SCRIPT = """
import json, sys, torch.distributed as dist
from engine import LLM
from engine.sampling_params import SamplingParams
llm = LLM(model=sys.argv[1], device="cuda", dtype="float32", max_model_len=80, num_gpu_blocks_override=64)
out = llm.generate(prompt_token_ids=json.loads(sys.argv[2]), use_tqdm=False,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
print(json.dumps({"backend": dist.get_backend(), "tokens": [o.outputs[0].token_ids for o in out]}))
llm.shutdown()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_nccl_world_of_one_gives_the_tokens_of_no_group(make_llm, tiny_llama_hd64_dir, prompt_ids):
    """A torchrun-style launch of one rank on the GPU: the model's all-reduces and its logits gather run
    through NCCL, and the tokens are those of the engine without a group."""
    port = str(free_port())
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port}
    run = subprocess.run([sys.executable, "-c", NCCL_SCRIPT, str(tiny_llama_hd64_dir), json.dumps(prompt_ids)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["backend"] == "nccl"
    reference = make_llm("tiny64", device="cuda").generate(
        prompt_token_ids=prompt_ids, sampling_params=greedy(12, ignore_eos=True), use_tqdm=False)
    assert got["tokens"] == [o.outputs[0].token_ids for o in reference]


def _family_configs():
    from transformers import Gemma3TextConfig, Phi3Config, Qwen3Config

    tiny = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return {
        "qwen3": lambda: Qwen3Config(**tiny, head_dim=32, tie_word_embeddings=False),
        "gemma3": lambda: Gemma3TextConfig(**tiny, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                           layer_types=["sliding_attention", "full_attention"]),
        "phi3": lambda: Phi3Config(**tiny, sliding_window=8, tie_word_embeddings=False),
    }


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_two_ranks_give_the_tokens_of_one_for_each_family(family, tmp_path, default_model_dir, prompt_ids):
    """The families' spec under TP=2 (4 heads, 2 key/value heads): Gemma 3's q/k norms (whole on every rank; Qwen3's
    are the same op), its norms of the row-parallel outputs after their all-reduce, its embedding scale after the
    vocab-parallel lookup; Phi-3's fused checkpoint tensors split into each rank's q/k/v and gate/up rows. (Qwen3
    adds nothing a rank does differently: _family_configs keeps it for a run by hand.)"""
    from engine import LLM
    from tiny_models import save_random_model

    folder = save_random_model(_family_configs()[family](), tmp_path, default_model_dir)
    params = greedy(MAX_TOKENS, ignore_eos=True, logprobs=1)
    outputs = {}
    for size in (1, 2):
        llm = LLM(model=str(folder), tensor_parallel_size=size, **ROOMY)
        try:
            outputs[size] = llm.generate(prompt_token_ids=prompt_ids[:4], sampling_params=params, use_tqdm=False)
        finally:
            llm.shutdown()
    assert token_ids(outputs[2]) == token_ids(outputs[1])
    assert max(abs(x - y) for a, b in zip(outputs[1], outputs[2]) for x, y in zip(_logprobs(a), _logprobs(b))) < 1e-3
