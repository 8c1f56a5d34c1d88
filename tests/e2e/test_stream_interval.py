"""stream_interval: a running request is reported with its first tokens, then every N steps, and at its end; what
the skipped steps made arrives with the next output, and the final outputs are those of stream_interval 1. A
final_only request (the offline LLM's) is reported once, when it has finished."""
from __future__ import annotations

import pytest

from e2e_helpers import MAX_TOKENS, assert_all_blocks_free, greedy, seeded_pair
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams


def run(engine, prompt_ids, final_only: bool = False) -> tuple[dict, dict]:
    """Every request's outputs step by step: {request id: [tokens of its first choice at each report]}, finals."""
    params = [greedy(), seeded_pair(), greedy(ignore_eos=True), SamplingParams(temperature=0.0, max_tokens=7),
              greedy(stop=["e"]), greedy(logprobs=2)]
    for i, p in enumerate(params):
        p.final_only = final_only
        engine.add_request(f"r{i}", prompt_token_ids=prompt_ids[i], params=p)
    seen: dict[str, list[int]] = {}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(len(out.outputs[0].token_ids) if out.outputs else 0)
            if out.finished:
                finals[out.request_id] = out
    return seen, finals


def choices(out) -> list[tuple]:
    return [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs]


@pytest.mark.parametrize("interval", [3, 5])
def test_reports_every_n_steps_and_ends_as_stream_interval_1(make_llm, prompt_ids, interval):
    _, reference = run(make_llm("tiny").engine, prompt_ids)
    engine = make_llm("tiny", stream_interval=interval).engine
    seen, finals = run(engine, prompt_ids)
    assert {k: choices(v) for k, v in finals.items()} == {k: choices(v) for k, v in reference.items()}
    for request_id, counts in seen.items():
        final = counts[-1]
        # the first token at once, then one report every `interval` tokens, and the last one
        expected = list(range(1, final, interval))
        expected += [final] if expected[-1] != final else []
        assert counts == expected, (request_id, counts)
    assert len(seen["r2"]) < MAX_TOKENS // interval + 3
    assert_all_blocks_free(engine)


def test_final_only_requests_are_reported_once_at_their_end(make_llm, prompt_ids):
    # LLM.generate's and non-streamed HTTP requests (their readers take the finished output only): no output is
    # built for them before.
    engine = make_llm("tiny").engine
    _, reference = run(engine, prompt_ids)
    seen, finals = run(engine, prompt_ids, final_only=True)
    assert {k: choices(v) for k, v in finals.items()} == {k: choices(v) for k, v in reference.items()}
    assert all(len(counts) == 1 for counts in seen.values()), seen
    assert_all_blocks_free(engine)


def test_a_stream_interval_below_1_is_refused():
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        EngineConfig(model="x", stream_interval=0)
