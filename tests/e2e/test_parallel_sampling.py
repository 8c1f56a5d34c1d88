"""n=4 samples of one prompt share its blocks: fewer blocks than four separate requests of the same prompt."""
from __future__ import annotations

from e2e_helpers import blocks_for
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus

BLOCK = 16
PROMPT_LEN = 2 * BLOCK + 8  # two full blocks the samples share, and a partial one each must own


def _used_blocks_while_decoding(engine, requests: list[tuple[str, SamplingParams]], prompt: list[int]) -> int:
    """Add the requests, step until every sequence has decoded once, and read the blocks in use then."""
    for request_id, params in requests:
        engine.add_request(request_id, prompt_token_ids=prompt, params=params)
    groups = lambda: list(engine.scheduler.running)  # noqa: E731
    while not groups() or any(s.get_output_len() < 2 for g in groups() for s in g.get_seqs(SequenceStatus.RUNNING)):
        engine.step()
    bm = engine.scheduler.block_manager
    used = bm.num_device_blocks - bm.get_num_free_device_blocks()
    while engine.has_unfinished_requests():
        engine.step()
    return used


def test_parallel_samples_share_prompt_blocks(make_llm):
    engine = make_llm("tiny").engine
    prompt = list(range(100, 100 + PROMPT_LEN))
    params = dict(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)

    parallel = _used_blocks_while_decoding(engine, [("n4", SamplingParams(n=4, **params))], prompt)
    separate = _used_blocks_while_decoding(
        engine, [(f"single-{i}", SamplingParams(**params)) for i in range(4)], prompt
    )
    # Four sequences of PROMPT_LEN + 1 tokens: each owns its partly filled last block;
    # forked samples share the two full prompt blocks, separate requests each hold a copy.
    assert separate == 4 * blocks_for(PROMPT_LEN + 1)
    assert parallel == PROMPT_LEN // BLOCK + 4
    assert parallel < separate
