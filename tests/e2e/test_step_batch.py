"""The steady decode on the tiny model: its steps keep the runner's input batch and the engine's per-row arrays
(sampling parameters, stop data), and give what listing every sequence each step gives: tokens, text, finish
reasons and logprobs, across block boundaries, requests finishing at different steps, and stop conditions."""
from __future__ import annotations

import random

from engine.sampling_params import SamplingParams


def _requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    out = []
    for i in range(12):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(2, 30))]
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(10, 45), ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=i, max_tokens=40, ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(temperature=1.0, min_p=0.05, seed=100 + i, max_tokens=45, ignore_eos=True,
                                    stop_token_ids=[rng.randrange(100, 40000) for _ in range(50)])
        else:
            params = SamplingParams(temperature=0.0, max_tokens=None, stop=["e"], ignore_eos=True)
        out.append((prompt, params))
    return out


def _run(llm, mode: str):
    """mode: "steady" (the default), "listed" (no steady decode: every step lists its sequences) or "per-sample"
    (also the per-sample sampler and output processor, which fault injection selects)."""
    engine = llm.engine
    engine.scheduler._steady_allowed = mode == "steady"
    engine.fault_injector = (lambda stage, ids: None) if mode == "per-sample" else None
    runner = engine.model_runner
    builds, build = [0], runner._build

    def counted(out):
        builds[0] += 1
        return build(out)

    runner._build = counted
    try:
        for i, (prompt, params) in enumerate(_requests()):
            engine.add_request(f"{mode}-{i}", prompt_token_ids=prompt, params=params)
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    finished[out.request_id.rsplit("-", 1)[1]] = out
    finally:
        runner._build = build
        engine.scheduler._steady_allowed = True
        engine.fault_injector = None
    results = {k: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, round(c.cumulative_logprob, 4))
                   for c in o.outputs] for k, o in finished.items()}
    return results, builds[0], steps


def test_steady_decode_gives_what_listing_every_sequence_gives(make_llm):
    llm = make_llm("tiny", max_model_len=80)
    steady, steady_builds, steps = _run(llm, "steady")
    listed, listed_builds, _ = _run(llm, "listed")
    per_sample, _, _ = _run(llm, "per-sample")
    assert len(steady) == 12
    assert steady == listed == per_sample
    reasons = {r[0][2] for r in steady.values()}
    assert reasons == {"stop", "length"}
    # The listed run builds its input every step; the steady one once per change of the running set (the prefill
    # steps, and one step after each request leaves), advancing the kept batch in every other step.
    assert listed_builds == steps
    assert steady_builds <= steps // 2
