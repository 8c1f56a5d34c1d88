"""The engine core process sends each step's outputs as deltas (engine/core_proc.py OutputDeltas) and the API
server rebuilds them (OutputAssembler): what comes out equals what went in, step by step, over the real msgpack
wire, whatever the outputs did between steps (appends, a text cut back by a stop string, choices appearing at the
end as beam search's do, prompt logprobs arriving late), and neither side keeps a request past its end."""
from __future__ import annotations

import copy

from engine import core_proc, wire
from engine.sequence import CompletionOutput, RequestMetrics, RequestOutput


def _output(rid, choices, finished=False, prompt_logprobs=None, error=None):
    # the metrics as the engine's change: the first token's time once there is one, the finish time at the end
    return RequestOutput(rid, "a prompt", [1, 2, 3], prompt_logprobs, choices, finished, error,
                         RequestMetrics(arrival_time=1.0, first_token_time=2.0 if choices else None,
                                        finished_time=4.0 if finished else None))


def _choice(index, text, ids, logprobs=None, reason=None, stop=None):
    return CompletionOutput(index, text, list(ids), -0.5 * len(ids), logprobs, reason, stop)


def _wire(deltas, assembler, outputs, live):
    enc, dec = wire.encoder(), wire.decoder(list[wire.Delta])
    return assembler.decode(dec.decode(enc.encode(deltas.encode(outputs))), live)


def test_deltas_rebuild_every_output_as_it_was_sent():
    deltas, assembler = core_proc.OutputDeltas(), core_proc.OutputAssembler()
    lp = [{5: -0.1, 9: -2.5}, {6: -0.2}, {7: -0.3}]
    plp = [None, {2: -1.0}, {3: -0.7}]
    steps = [
        [_output("a", [_choice(0, "He", [5], lp[:1])]), _output("b", [_choice(0, "x", [8]), _choice(1, "y", [9])])],
        [_output("a", [_choice(0, "Hello", [5, 6], lp[:2])]), _output("b", [_choice(0, "x!", [8, 4]),
                                                                           _choice(1, "yo", [9, 4])])],
        # a stop string found: the text cut back, the tokens kept; b's prompt logprobs arrive late
        [_output("a", [_choice(0, "Hel", [5, 6, 7], lp, "stop", "lo")], finished=True),
         _output("b", [_choice(0, "x!!", [8, 4, 4])], prompt_logprobs=plp)],
        # beam search's way: nothing, then the chosen choices at the end
        [_output("b", [])],
        [_output("b", [_choice(0, "best", [1, 2]), _choice(1, "next", [3])], finished=True, prompt_logprobs=plp)],
    ]
    live = {"a", "b"}
    for step in steps:
        got = _wire(deltas, assembler, copy.deepcopy(step), live)
        assert got == step
        for out in got:
            if out.finished:
                live.discard(out.request_id)
    assert deltas._sent == {} and assembler._requests == {}  # nothing kept past a request's end


def test_an_aborted_request_is_dropped_on_both_sides():
    deltas, assembler = core_proc.OutputDeltas(), core_proc.OutputAssembler()
    live = {"a", "b"}
    first = [_output("a", [_choice(0, "x", [1])]), _output("b", [_choice(0, "y", [2])])]
    assert _wire(deltas, assembler, first, live) == first
    live.discard("a")  # the frontend aborts a; the core had already sent its next output
    assembler.forget(["a"])
    second = [_output("a", [_choice(0, "xx", [1, 1])]), _output("b", [_choice(0, "yy", [2, 2])])]
    assert _wire(deltas, assembler, second, live) == second[1:]
    deltas.forget(["a"])  # the core applies the abort
    assert set(deltas._sent) == {"b"} and set(assembler._requests) == {"b"}
    # a first output (prompt included) of a request aborted before it arrived is not taken up either
    assert _wire(deltas, assembler, [_output("c", [_choice(0, "z", [3])])], live) == []
    assert set(assembler._requests) == {"b"}
    # an abort that lands while a step's outputs are decoded (its request taken up again by that decode) is
    # applied at the next decode: forget and clear only queue their work, so an aborting thread never waits
    assembler.forget(["b"])
    assert set(assembler._requests) == {"b"}
    assert _wire(deltas, assembler, [], live - {"b"}) == [] and assembler._requests == {}
    live.add("d")
    assert len(_wire(deltas, assembler, [_output("d", [_choice(0, "w", [4])])], live)) == 1
    deltas.clear(), assembler.clear()
    _wire(deltas, assembler, [], live)  # (the next step's decode applies the clear)
    assert deltas._sent == {} and assembler._requests == {}
