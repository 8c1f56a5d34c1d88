"""Chunked prefill (--enable-chunked-prefill): prompts cut into chunks, mixed with decodes, same tokens as HF."""
from __future__ import annotations

import pytest

from e2e_helpers import MAX_MODEL_LEN, MAX_TOKENS, greedy, hf_logprobs, seeded_pair, token_ids

# A budget far below the longest prompt (> 48 tokens): most prompts take several steps, and the steps that
# finish a prompt also decode the ones already running. max_num_seqs must fit in the budget.
CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=8)


class StepLog:
    """Records what each schedule() of an engine's scheduler put in its step."""

    def __init__(self, engine) -> None:
        self.steps: list[list[tuple[str, bool, int, bool]]] = []
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def logged():
            out = schedule()
            self.steps.append([(sg.group.request_id, sg.is_prefill, sg.num_tokens, sg.do_sample) for sg in out.scheduled])
            return out

        scheduler.schedule = logged
        self._undo = lambda: scheduler.__dict__.pop("schedule")

    def close(self) -> None:
        self._undo()

    @property
    def partial_chunks(self) -> int:
        return sum(1 for step in self.steps for _, prefill, _, samples in step if prefill and not samples)

    @property
    def mixed_steps(self) -> int:
        """Steps that decode some sequences while prefilling a prompt chunk."""
        return sum(1 for step in self.steps if any(p for _, p, _, _ in step) and any(not p for _, p, _, _ in step))


@pytest.fixture
def step_log():
    logs = []

    def attach(llm) -> StepLog:
        logs.append(StepLog(llm.engine))
        return logs[-1]

    yield attach
    for log in logs:
        log.close()


def test_default_model_greedy_is_unchanged_by_chunking(make_llm, prompt_ids, smol_greedy_outputs, step_log):
    llm = make_llm("smol", **CHUNKED)
    log = step_log(llm)
    outputs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(), use_tqdm=False)
    # smol_greedy_outputs equal HF's greedy tokens (test_parity.py).
    assert token_ids(outputs) == token_ids(smol_greedy_outputs)
    assert [o.outputs[0].finish_reason for o in outputs] == [o.outputs[0].finish_reason for o in smol_greedy_outputs]
    assert log.partial_chunks >= 2 and log.mixed_steps >= 2
    assert all(sum(n for _, _, n, _ in step) <= CHUNKED["max_num_batched_tokens"] for step in log.steps)
    stats = llm.engine.get_stats()
    assert stats.prompt_tokens_total >= sum(len(p) for p in prompt_ids)


def test_prompt_longer_than_the_budget_is_served(make_llm, prompt_ids, smol_greedy_outputs, step_log):
    # Without chunking a prompt longer than max_num_batched_tokens is an error; with it, several steps.
    llm = make_llm("smol", **CHUNKED)
    log = step_log(llm)
    longest = prompt_ids[-1]
    assert len(longest) > 2 * CHUNKED["max_num_batched_tokens"]
    (out,) = llm.generate(prompt_token_ids=[longest], sampling_params=greedy(), use_tqdm=False)
    assert out.error is None
    assert out.outputs[0].token_ids == smol_greedy_outputs[-1].outputs[0].token_ids
    chunks = [n for step in log.steps for rid, prefill, n, _ in step if prefill]
    assert sum(chunks) == len(longest) and len(chunks) >= 3


def test_prompt_logprobs_across_chunks_match_hf(make_llm, hf_smol, prompt_ids):
    prompt = prompt_ids[-1]
    params = greedy(max_tokens=2, prompt_logprobs=3)
    out = make_llm("smol", **CHUNKED).generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    ref = hf_logprobs(hf_smol, prompt)
    for i, (token, logprobs) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:])):
        assert logprobs[token] == pytest.approx(ref[i, token].item(), abs=1e-3), f"prompt token {i + 1}"
        assert set(ref[i].topk(3).indices.tolist()) <= set(logprobs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_model_outputs_survive_preemption_while_chunking(make_llm, prompt_ids, mode):
    reference = make_llm("tiny")
    ref_greedy = token_ids(reference.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True),
                                              use_tqdm=False))
    ref_seeded = token_ids(reference.generate(prompt_token_ids=prompt_ids,
                                              sampling_params=seeded_pair(ignore_eos=True), use_tqdm=False))
    # Room for two max-length sequences and one block more: the batch preempts, prompts half-prefilled too.
    blocks = 2 * -(-MAX_MODEL_LEN // 16) + 1
    llm = make_llm("tiny", **CHUNKED, num_gpu_blocks_override=blocks, preemption_mode=mode)
    before = llm.engine.get_stats()
    out_greedy = llm.generate(prompt_token_ids=prompt_ids, sampling_params=greedy(ignore_eos=True), use_tqdm=False)
    out_seeded = llm.generate(prompt_token_ids=prompt_ids, sampling_params=seeded_pair(ignore_eos=True),
                              use_tqdm=False)
    after = llm.engine.get_stats()
    counter = f"num_preemptions_{mode}"
    assert getattr(after, counter) > getattr(before, counter), "nothing was preempted"
    assert [out.error for out in out_greedy + out_seeded if out.error] == []
    assert token_ids(out_greedy) == ref_greedy
    assert token_ids(out_seeded) == ref_seeded
    assert all(len(c) == MAX_TOKENS for req in token_ids(out_seeded) for c in req)


def test_prefix_cache_hits_with_chunking(make_llm, prompt_ids, smol_greedy_outputs):
    llm = make_llm("smol", **CHUNKED, enable_prefix_caching=True)
    longest = prompt_ids[-1]
    first = llm.generate(prompt_token_ids=[longest], sampling_params=greedy(), use_tqdm=False)
    again = llm.generate(prompt_token_ids=[longest, prompt_ids[3]], sampling_params=greedy(), use_tqdm=False)
    assert llm.engine.get_stats().prefix_cache_hit_rate > 0
    expected = token_ids([smol_greedy_outputs[-1]])
    assert token_ids(first) == expected and token_ids(again[:1]) == expected
    assert token_ids(again[1:]) == token_ids([smol_greedy_outputs[3]])
