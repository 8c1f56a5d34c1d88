"""With the engine core in its own process, the API server detokenizes (engine/core_proc.py OutputAssembler): the
core sends token ids only, except for requests whose text the engine reads itself (stop strings, beam search,
best_of). Every step's outputs, rebuilt on the server's side from the deltas the core builds straight from its
sequences (OutputDeltas), are the ones an engine that detokenizes everything gives: the same text after each step,
the same end of it (a stop token's text left out or kept, a length cap's held-back bytes flushed, a stop string's
cut), the same choices (forked, chosen at the end by beam search or best_of) and logprobs, over the real msgpack
wire."""
from __future__ import annotations

import copy

from engine import core_proc, wire
from engine.detokenizer import Detokenizer, engine_reads_text
from engine.sampling_params import SamplingParams

PROMPTS = [[1450, 2001, 314, 9054, 28, 3022], [504, 3458, 282, 2585, 314], [9, 216, 17, 1672, 30, 7, 118]]


def _requests(tokenizer) -> list[tuple[str, list[int], SamplingParams]]:
    stops = list(range(100, len(tokenizer), 9))  # ~11 % of the vocabulary: runs stop within a few tokens
    # byte pieces that are no character alone: a length cap lands inside a character, whose bytes are flushed
    pieces = [i for i in range(512) if tokenizer.decode([i]) == "\ufffd"]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),  # a length cap
        SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=stops),
        SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=stops, include_stop_str_in_output=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=40, n=2, stop_token_ids=stops[::3]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, skip_special_tokens=False),
        SamplingParams(temperature=1.0, seed=11, max_tokens=5, allowed_token_ids=pieces, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["e", " the"], ignore_eos=True),  # read by the engine
        SamplingParams(temperature=1.0, seed=5, max_tokens=20, n=1, best_of=3),  # read by the engine
        # several choices, each cut by a stop string at its own step, their text held back meanwhile; logprobs
        SamplingParams(temperature=1.0, seed=13, max_tokens=30, n=2, stop=["e ", "a"], logprobs=2),
        SamplingParams(temperature=1.0, seed=17, max_tokens=12, n=3, logprobs=1, prompt_logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=10, n=2, best_of=3, use_beam_search=True),  # beams reorder
        SamplingParams(temperature=0.0, max_tokens=8, n=2, use_beam_search=True, stop=["o"], logprobs=1),
    ]
    return [(f"r{k}-{i}", prompt, params) for k, params in enumerate(cases) for i, prompt in enumerate(PROMPTS)]


def _run(engine, requests) -> list[list]:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt_token_ids=prompt, params=params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(_timeless(engine.step()))
    return steps


def _timeless(outputs: list) -> list:
    """The outputs less their timestamps (two runs differ there only)."""
    outputs = copy.deepcopy(outputs)
    for out in outputs:
        out.metrics = None
    return outputs


def test_text_decoded_by_the_api_server_is_the_engines(make_llm):
    engine = make_llm("tiny").engine
    requests = _requests(engine.tokenizer)
    assert sum(not engine_reads_text(p) for _, _, p in requests) > len(requests) // 2
    want = _run(engine, requests)

    deltas, assembler = core_proc.OutputDeltas(), core_proc.OutputAssembler(Detokenizer(engine.tokenizer))
    enc, dec = wire.encoder(), wire.decoder(list[wire.Delta])
    live = {request_id for request_id, _, _ in requests}

    def register(request_id, params):
        if not engine_reads_text(params):
            assembler.decode_text(request_id, params)

    engine.output_processor.detokenize_all = False  # as in the core process
    engine.output_builder = deltas.build  # step() reports wire.Deltas, as in the core process
    try:
        core_steps = []
        for request_id, prompt, params in requests:
            engine.add_request(request_id, prompt_token_ids=prompt, params=params)
            register(request_id, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            core_steps.append(outputs)
            got = _timeless(assembler.decode(dec.decode(enc.encode(outputs)), live))
            assert got == want[len(core_steps) - 1], f"step {len(core_steps)}"
            live.difference_update(o.request_id for o in got if o.finished)
    finally:
        engine.output_processor.detokenize_all = True
        engine.output_builder = None
        engine.abort_request([request_id for request_id, _, _ in requests])  # (a failed check leaves some running)
    assert len(core_steps) == len(want) and not live
    assert assembler._requests == {} and assembler._here == {} and deltas._sent == {}
    # the core itself decoded only the requests whose text it reads
    for request_id, _, params in requests:
        texts = [c.text for step in core_steps for d in step if d.request_id == request_id for c in d.choices]
        assert (any(texts) if engine_reads_text(params) else not any(texts)), (request_id, texts)
    # a steady step sent only what was new: one token id a step after a request's first output
    sizes: dict[str, list[int]] = {}
    for step in core_steps:
        for d in step:
            sizes.setdefault(d.request_id, []).extend(len(c.token_ids) for c in d.choices)
    assert all(set(sizes[f"r0-{i}"][1:]) == {1} for i in range(len(PROMPTS))), sizes
    # the cases did what they are there for: stops with and without their text, length caps, several choices
    finals = {o.request_id: o for step in want for o in step if o.finished}
    reasons = {c.finish_reason for o in finals.values() for c in o.outputs}
    assert reasons == {"stop", "length"}
    assert any(o.outputs[0].stop_reason is not None for k, o in finals.items() if k.startswith("r2-"))
    assert all(len(o.outputs) == 2 for k, o in finals.items() if k.startswith(("r8-", "r10-", "r11-")))
    assert any(c.stop_reason in ("e ", "a") for k, o in finals.items() if k.startswith("r8-") for c in o.outputs)


def test_an_engine_core_leaves_the_text_to_the_api_server_after_a_reset_too(make_llm):
    """An engine core process's LLMEngine (detokenize_all=False) builds a new output processor when it resets after a
    fault: that one too decodes no text the API server decodes (it once decoded all of it again, for good)."""
    engine = make_llm("tiny").engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.detokenize_all = False
    try:
        engine.reset()
        engine.add_request("after-reset", prompt_token_ids=PROMPTS[0], params=params)
        last = None
        while engine.has_unfinished_requests():
            last = engine.step()[-1]
    finally:
        engine.detokenize_all = True
        engine.reset()
    assert len(last.outputs[0].token_ids) == 6 and last.outputs[0].text == ""
