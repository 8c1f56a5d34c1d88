"""The engine core process sends each step's outputs as deltas built straight from the sequences
(engine/core_proc.py OutputDeltas) and the API server rebuilds them (OutputAssembler): what comes out equals the
RequestOutput an in-process engine reports (OutputProcessor.to_request_output), step by step, over the real msgpack
wire, whatever the sequences did between steps (appends, text held back and then cut by a stop string, choices
forked, beam search's choices appearing at the end in score order, prompt logprobs arriving late, a text cut back
below what was sent), each step sending only what is new, and neither side keeps a request past its end."""
from __future__ import annotations

import copy

from engine import core_proc, wire
from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus


def _group(rid, **params):
    group = SequenceGroup(rid, [Sequence(0, [1, 2, 3])], SamplingParams(**params), arrival_time=1.0,
                          prompt="a prompt")
    group.seqs[0].status = SequenceStatus.RUNNING
    return group


def _grow(seq, text, *tokens):
    for token in tokens:
        seq.append_token(token, {token: -0.25 * token, 99: -3.0})
    seq.output_text += text


def _step(deltas, assembler, groups, live):
    """One step: the wire's deltas of `groups` rebuilt, and the RequestOutputs an in-process engine reports."""
    enc, dec = wire.encoder(), wire.decoder(list[wire.Delta])
    want = [copy.deepcopy(OutputProcessor.to_request_output(g)) for g in groups]
    sent = [deltas.build(g) for g in groups]
    got = assembler.decode(dec.decode(enc.encode(sent)), live)
    for out in got:
        if out.finished:
            live.discard(out.request_id)
    return got, want, sent


def test_deltas_rebuild_every_output_as_the_engine_reports_it():
    deltas, assembler = core_proc.OutputDeltas(), core_proc.OutputAssembler()
    a = _group("a", max_tokens=20, logprobs=1, stop=["lo!"])  # 2 characters held back while running
    b = _group("b", max_tokens=20, n=2, temperature=1.0)
    c = _group("c", max_tokens=20, n=2, best_of=3, use_beam_search=True, temperature=0.0)
    live = {"a", "b", "c"}
    sa, sb, sc = a.seqs[0], b.seqs[0], c.seqs[0]

    _grow(sa, "He", 5), _grow(sb, "x", 8), _grow(sc, "p", 4)
    b.add(sb.fork(1)), c.add(sc.fork(2)), c.add(sc.fork(3))
    b.seqs[1].output_text = "y"
    got, want, sent = _step(deltas, assembler, [a, b, c], live)
    assert got == want and [len(d.choices) for d in sent] == [1, 2, 0]  # beams: nothing until the end
    assert sent[0].choices[0].text == ""  # "He" held back: a stop string could start there

    _grow(sa, "llo", 6), _grow(sb, "!", 4), _grow(b.seqs[1], "o", 4)
    for k, seq in enumerate(c.seqs):
        _grow(seq, "qrs"[k], 5 + k)
    b.prompt_logprobs = [None, {2: -1.0}, {3: -0.7}]  # arriving late: the prompt goes again
    got, want, sent = _step(deltas, assembler, [a, b, c], live)
    assert got == want and sent[1].prompt is not None and sent[0].prompt is None
    assert [(c.keep_ids, c.token_ids, c.keep_text, c.text) for c in sent[0].choices] == [(1, [6], 0, "Hel")]

    # a's stop string found: the text cut back to before it (not below what was sent), the tokens kept; one of b's
    # choices ends; c's beams end, the best first (not the group's order), one of them dropped
    _grow(sa, "lo!", 7)
    sa.output_text, sa.stop_reason, sa.status = "Hel", "lo!", SequenceStatus.FINISHED_STOPPED
    _grow(sb, "!", 4)
    sb.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    for seq in c.seqs:
        seq.status = SequenceStatus.FINISHED_STOPPED
    c.seqs[2].cumulative_logprob = 0.0
    c.remove(c.seqs[0].seq_id)
    got, want, sent = _step(deltas, assembler, [a, b, c], live)
    assert got == want and [o.finished for o in got] == [True, False, True]
    assert [o.text for o in got[2].outputs] == ["ps", "pr"]
    assert sent[0].choices[0].keep_ids == 2 and sent[0].choices[0].keep_text == 3 and sent[0].choices[0].text == ""

    # b's running choice: its text cut back below what was sent (no engine path does it today): it goes whole
    b.seqs[1].output_text = "y"
    _grow(b.seqs[1], "", 3)
    got, want, sent = _step(deltas, assembler, [b], live)
    assert got == want and sent[0].choices[1].keep_text == 0 and sent[0].choices[1].keep_ids == 0
    assert sent[0].choices[0].keep_ids == 3 and sent[0].choices[0].token_ids == []  # the ended one: nothing new
    b.seqs[1].status = SequenceStatus.FINISHED_STOPPED
    got, want, _ = _step(deltas, assembler, [b], live)
    assert got == want and got[0].finished and not live
    assert deltas._sent == {} and assembler._requests == {}  # nothing kept past a request's end


def test_an_aborted_request_is_dropped_on_both_sides():
    deltas, assembler = core_proc.OutputDeltas(), core_proc.OutputAssembler()
    live = {"a", "b"}
    a, b = _group("a", max_tokens=9), _group("b", max_tokens=9)
    _grow(a.seqs[0], "x", 1), _grow(b.seqs[0], "y", 2)
    got, want, _ = _step(deltas, assembler, [a, b], live)
    assert got == want
    live.discard("a")  # the frontend aborts a; the core had already sent its next output
    assembler.forget(["a"])
    _grow(a.seqs[0], "x", 1), _grow(b.seqs[0], "y", 2)
    got, want, _ = _step(deltas, assembler, [a, b], live)
    assert got == want[1:]
    deltas.forget(["a"])  # the core applies the abort
    assert set(deltas._sent) == {"b"} and set(assembler._requests) == {"b"}
    # a first output (prompt included) of a request aborted before it arrived is not taken up either
    c = _group("c", max_tokens=9)
    _grow(c.seqs[0], "z", 3)
    assert _step(deltas, assembler, [c], live)[0] == []
    assert set(assembler._requests) == {"b"}
    # an abort that lands while a step's outputs are decoded (its request taken up again by that decode) is
    # applied at the next decode: forget and clear only queue their work, so an aborting thread never waits
    assembler.forget(["b"])
    assert set(assembler._requests) == {"b"}
    assert _step(deltas, assembler, [], live - {"b"})[0] == [] and assembler._requests == {}
    live.add("d")
    d = _group("d", max_tokens=9)
    _grow(d.seqs[0], "w", 4)
    assert len(_step(deltas, assembler, [d], live)[0]) == 1
    deltas.clear(), assembler.clear()
    _step(deltas, assembler, [], live)  # (the next step's decode applies the clear)
    assert deltas._sent == {} and assembler._requests == {}
