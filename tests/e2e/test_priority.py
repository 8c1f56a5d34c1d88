"""Request priority end to end (--scheduling-policy priority), and per-request budgets from one SamplingParams."""
from __future__ import annotations

import pytest

from e2e_helpers import MAX_MODEL_LEN, greedy, token_ids

from engine.sampling_params import SamplingParams

def _status(engine, request_id: str) -> str:
    sched = engine.scheduler
    for name in ("waiting", "running", "swapped"):
        if any(g.request_id == request_id for g in getattr(sched, name)):
            return name
    return "done"


def test_late_urgent_request_overtakes_the_queue_and_preempts_a_running_one(make_llm, prompt_ids):
    llm = make_llm("tiny", scheduling_policy="priority", max_num_seqs=2)
    engine = llm.engine
    params = greedy(max_tokens=12, ignore_eos=True)
    prompts = {name: prompt_ids[i] for i, name in enumerate(("a", "b", "queued", "urgent"), start=1)}
    reference = dict(zip(prompts, token_ids(llm.generate(prompt_token_ids=list(prompts.values()),
                                                           sampling_params=params, use_tqdm=False))))
    preempted_before = engine.get_stats().num_preemptions_recompute

    for name in ("a", "b", "queued"):  # two run (max_num_seqs=2), one queues
        engine.add_request(name, prompt_token_ids=prompts[name], params=params, priority=5)
    finished, first_token_step = {}, {}
    step = 0

    def run_step():
        nonlocal step
        step += 1
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                first_token_step.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = (step, out)

    for _ in range(3):
        run_step()
    assert [_status(engine, n) for n in ("a", "b", "queued")] == ["running", "running", "waiting"]

    engine.add_request("urgent", prompt_token_ids=prompts["urgent"], params=params, priority=0)
    run_step()
    # It did not wait behind "queued", nor for a free slot: the latest-arrived running request made room.
    assert _status(engine, "urgent") == "running" and first_token_step["urgent"] == step
    assert [_status(engine, n) for n in ("a", "b", "queued")] == ["running", "waiting", "waiting"]
    assert engine.get_stats().num_preemptions_recompute == preempted_before + 1
    assert [g.request_id for g in engine.scheduler.waiting] == ["b", "queued"]  # b keeps its place in line

    while engine.has_unfinished_requests():
        run_step()
    assert finished["urgent"][0] < first_token_step["queued"]
    # Preempted or not, every request gets the tokens it would have got alone.
    assert {name: token_ids([out])[0] for name, (_, out) in finished.items()} == reference
    assert all(out.outputs[0].finish_reason == "length" for _, out in finished.values())


def test_generate_takes_priority_per_prompt_or_one_for_all(make_llm, prompt_ids):
    llm = make_llm("tiny", scheduling_policy="priority", max_num_seqs=1)
    prompts = prompt_ids[1:4]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(max_tokens=4), priority=[2, 0, 1],
                           use_tqdm=False)
    assert [out.prompt_token_ids for out in outputs] == prompts  # results in the prompts' order
    started = [out.metrics.first_scheduled_time for out in outputs]
    assert started[1] < started[2] < started[0]  # one at a time, lowest priority value first
    assert len(llm.generate(prompt_token_ids=prompts, sampling_params=greedy(max_tokens=2), priority=3,
                            use_tqdm=False)) == 3
    with pytest.raises(ValueError, match="priority"):
        llm.generate(prompt_token_ids=prompts, priority=[0, 1], use_tqdm=False)


def test_max_tokens_none_gives_each_prompt_its_own_budget_and_leaves_params_alone(make_llm, prompt_ids):
    llm = make_llm("tiny")
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    short, long = prompt_ids[1], prompt_ids[-1]
    assert len(short) < len(long)
    outputs = llm.generate(prompt_token_ids=[short, long], sampling_params=params, use_tqdm=False)
    # Each generates until the context is full: its own budget, not the first prompt's.
    assert [len(out.outputs[0].token_ids) for out in outputs] == [MAX_MODEL_LEN - len(short), MAX_MODEL_LEN - len(long)]
    assert all(out.outputs[0].finish_reason == "length" for out in outputs)
    assert params.max_tokens is None
