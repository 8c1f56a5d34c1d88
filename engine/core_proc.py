"""The engine core in a process of its own: a busy loop (apply adds and aborts, step, send the step's outputs)
reached over ZMQ with msgpack (msgspec). The API-server process drives it through RemoteEngineCore
(engine/frontend/core_client.py), which AsyncLLMEngine uses as it uses an in-process LLMEngine.

The messages, typed, are engine/wire.py's; a step's outputs travel as deltas (OutputDeltas, OutputAssembler), which
the core's step() builds straight from its sequences (no RequestOutput is made there).
Text: the core decodes only the requests whose text it reads itself (stop strings, beam search, best_of); the
others' choices carry token ids only, and the frontend's OutputAssembler decodes them (vLLM V1 detokenizes in its
API server too), so the core's step does not pay for it.
The core never outlives the frontend: PR_SET_PDEATHSIG (SIGKILL) and a thread watching its parent end it. Under
tensor parallelism the core is rank 0 and starts the other ranks as LLMEngine does in one process; a rank that dies
while the core idles ends the core within _RANK_POLL_MS (the frontend then answers 503 and exits 1, as in one
process). Why the core stopped is also written to the file `fatal_path`, for the frontend to read when it sees the
exit without having read the "fatal" message (its step thread idle, or racing the exit).
Test hook, off by default: PAGEDSERVE_CORE_FAULT_INJECTOR="module:factory" in the environment of the process that
starts the core makes the core call factory(engine) once its LLMEngine is built and set what it returns as the
engine's fault_injector (engine/faults.py), as the reliability tests set it on an in-process engine. Only the
server's environment can set it; nothing a request carries can.
A request whose structured-output grammar the core has not compiled yet is compiled in a thread of the core
(xgrammar lets go of the GIL) and added when its grammar is ready: a new schema costs its own request's time, not
every running stream's.
"""
from __future__ import annotations

import importlib
import logging
import os
import queue
import collections
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Container, Iterable, Optional

import msgspec
import zmq

from engine import wire
from engine.config import EngineConfig
from engine.platform.parent import exit_with_parent
from engine.sequence import FINISH_REASONS, UNFINISHED, CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


_COMPILE_POLL_MS = 10  # idle but compiling: how often the loop looks for a compiled grammar
_RANK_POLL_MS = 100  # idle under tensor parallelism: how often the loop looks for a rank that died
FAULT_INJECTOR_ENV = "PAGEDSERVE_CORE_FAULT_INJECTOR"  # the test hook (see above)


class OutputDeltas:
    """The core's side of the output deltas, built straight from the sequences: what step() reports of a group
    (LLMEngine.output_builder) is its wire.Delta, what changed since the request's last one, as OutputAssembler
    reads it. No RequestOutput is made, copied or compared: per request it keeps each choice's Sequence and how many
    of its token ids, logprobs and text characters went out, so a step that appended costs its new tokens, not the
    output's length. A choice whose sequence is not the one sent before (a fork's first output; beam search's and
    best_of's choices, chosen at the end) or whose text is shorter than what was sent goes whole (kept lengths 0).
    The text only grows otherwise: a stop string or stop token cuts only what was held back or is new this step.
    The choices, their text held back and their logprobs are output_processor.reported's, as to_request_output's.
    Kept until the request's final output, or until forget() (an abort, a failed step's ended requests) or a
    reset."""

    def __init__(self) -> None:
        from engine.output_processor import reported  # (here: the API server imports this module, not torch)

        self._reported = reported
        # request id -> [its prompt logprobs as sent, each choice's [Sequence, ids, logprobs, characters] sent]
        self._sent: dict[str, list] = {}

    def build(self, group: Any) -> wire.Delta:
        seqs, hold, keep_logprobs = self._reported(group)
        request_id = group.request_id
        finished = group.is_finished()
        state = self._sent.get(request_id)
        resend = state is None or state[0] is not group.prompt_logprobs
        last = state[1] if state is not None else []
        choices, sent = [], []
        for index, seq in enumerate(seqs):
            ids, text, status, logprobs = seq.output_token_ids, seq.output_text, seq.status, seq.output_logprobs
            chars = max(len(text) - hold, 0) if hold and status in UNFINISHED else len(text)
            was = last[index] if index < len(last) else None
            if was is not None and was[0] is seq and chars >= was[3]:  # the usual step: appended only
                _, keep_ids, keep_lps, keep_text = was
            else:
                was, keep_ids, keep_lps, keep_text = [seq, 0, 0, 0], 0, 0, 0
            was[1], was[2], was[3] = len(ids), len(logprobs) if keep_logprobs else 0, chars
            sent.append(was)
            choices.append(wire.ChoiceDelta(
                index, keep_text, text[keep_text:chars], keep_ids, ids[keep_ids:], seq.cumulative_logprob, keep_lps,
                logprobs[keep_lps:] if keep_logprobs else None, FINISH_REASONS.get(status), seq.stop_reason))
        if finished:
            self._sent.pop(request_id, None)
        else:
            self._sent[request_id] = [group.prompt_logprobs, sent]
        prompt = wire.Prompt(group.prompt, group.seqs[0].prompt_token_ids, group.prompt_logprobs) if resend else None
        return wire.Delta(request_id, prompt, finished, group.error, group.metrics, choices)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._sent.pop(request_id, None)

    def clear(self) -> None:
        self._sent.clear()


class _Text:
    """One choice's text, decoded on the API server's side: what the Detokenizer reads and writes of a Sequence."""

    __slots__ = ("prompt_token_ids", "output_token_ids", "output_text", "detok", "last", "ended")

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids, self.output_token_ids, self.output_text = prompt_token_ids, [], ""
        self.detok = None  # the Detokenizer's stream
        self.last = 0  # characters the last token decoded added
        self.ended = False


class OutputAssembler:
    """The frontend's side: output deltas back into whole RequestOutputs (each with its own lists, as an in-process
    engine's). A delta of a request not in `live` (aborted here while the core sent it) is dropped. decode runs on the
    step thread; forget and clear, called from the thread that aborts or resets, only queue their work for decode's
    next call, so the event loop never waits on a step's decoding (and an abort racing a decode cannot be undone by
    it: the forget applies after). decode_text applies them first too: a request registered after a clear keeps
    its registration.

    Detokenization is done here, as vLLM V1's API server does it, for every request registered with decode_text
    (all but those whose text the engine reads itself: engine/detokenizer.py engine_reads_text): the core sends
    their token ids only, and the same incremental Detokenizer turns them into text here, ending it as the engine's
    stop checks would (an EOS or stop token's own text left out unless include_stop_str_in_output; a length cap
    flushes bytes held back for an unfinished character). That work leaves the core's step, which is what feeds
    the model."""

    def __init__(self, detokenizer: Optional[Any] = None) -> None:
        # request id -> [its wire.Prompt, each choice's [text, ids, logprobs, _Text]]
        self._requests: dict[str, list] = {}
        self._pending: collections.deque = collections.deque()  # request ids to forget; None: forget all
        self._detokenizer = detokenizer
        # request id -> (skip_special_tokens, include_stop_str_in_output) of a request whose text is decoded here
        self._here: dict[str, tuple[bool, bool]] = {}

    def decode_text(self, request_id: str, params: Any) -> None:
        """Decode this request's text here (call before its add is sent, on the thread that calls decode)."""
        self._apply_pending()
        self._here[request_id] = (params.skip_special_tokens, params.include_stop_str_in_output)

    def decode(self, items: list[wire.Delta], live: Container[str]) -> list[RequestOutput]:
        self._apply_pending()
        outputs = self._decode(items, live)
        self._apply_pending()
        return outputs

    def _apply_pending(self) -> None:
        while self._pending:
            request_id = self._pending.popleft()
            if request_id is None:
                self._requests.clear()
                self._here.clear()
            else:
                self._requests.pop(request_id, None)
                self._here.pop(request_id, None)

    def _decode(self, items: list[wire.Delta], live: Container[str]) -> list[RequestOutput]:
        outputs = []
        for item in items:
            request_id = item.request_id
            if request_id not in live:
                self._requests.pop(request_id, None)
                self._here.pop(request_id, None)
                continue
            here = self._here.get(request_id)
            state = self._requests.get(request_id)
            if item.prompt is not None:
                state = [item.prompt, state[1] if state is not None else []]
            elif state is None:
                continue
            prompt, last = state
            completions = []
            for j, c in enumerate(item.choices):
                if j == len(last):
                    last.append(["", [], [], None])
                acc = last[j]
                del acc[1][c.keep_ids:]
                acc[1].extend(c.token_ids)
                if here is None:
                    acc[0] = (acc[0] if c.keep_text == len(acc[0]) else acc[0][:c.keep_text]) + c.text
                else:
                    acc[0] = self._text(acc, c.keep_ids, c.token_ids, c.finish_reason, here, prompt.token_ids)
                if c.logprobs is not None:
                    del acc[2][c.keep_logprobs:]
                    acc[2].extend(c.logprobs)  # (msgpack keeps the dicts' int keys)
                completions.append(CompletionOutput(c.index, acc[0], list(acc[1]), c.cumulative_logprob,
                                                    None if c.logprobs is None else list(acc[2]), c.finish_reason,
                                                    c.stop_reason))
            del last[len(item.choices):]
            if item.finished:
                self._requests.pop(request_id, None)
                self._here.pop(request_id, None)
            else:
                self._requests[request_id] = state
            outputs.append(RequestOutput(request_id, prompt.text, prompt.token_ids, prompt.logprobs, completions,
                                         item.finished, item.error, item.metrics))
        return outputs

    def _text(self, acc: list, keep_ids: int, ids: list[int], reason: Optional[str], here: tuple[bool, bool],
              prompt_token_ids: list[int]) -> str:
        """The choice's text after its new token ids, decoded here (see the class)."""
        detokenizer, (skip, keep_stop_text) = self._detokenizer, here
        text = acc[3]
        if text is None or keep_ids != len(text.output_token_ids):  # the first ids, or ids taken back: from the start
            text = acc[3] = _Text(prompt_token_ids)
            ids = acc[1]
        text.last = 0
        for token in ids:
            text.output_token_ids.append(token)
            text.last = len(detokenizer.decode_next(text, skip))
        if reason is not None and not text.ended:  # as OutputProcessor._check_stop ends a sequence's text
            text.ended = True
            if reason == "length":
                detokenizer.flush(text)
            elif reason == "stop" and text.last and not keep_stop_text:  # an EOS / stop token / grammar's end
                text.output_text = text.output_text[:-text.last]
        return text.output_text

    def forget(self, request_ids: Iterable[str]) -> None:
        self._pending.extend(request_ids)

    def clear(self) -> None:
        self._pending.append(None)


def core_main(config: EngineConfig, in_addr: str, out_addr: str, parent: int,
              fatal_path: Optional[str] = None) -> None:
    """Entry point of the spawned core process."""
    # The API server decides when to stop (it drains first, then sends "stop"): Ctrl-C or a SIGTERM sent to the
    # whole process group must not end the core under requests in flight.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    exit_with_parent(parent, "core-parent-watch")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s core %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    enc = wire.encoder()
    try:
        code = EngineCoreLoop(config, inbox, outbox, enc, fatal_path).run()
    except BaseException as exc:  # startup failed or the loop broke: say why, then exit non-zero
        logger.exception("the engine core stopped")
        _say_fatal(outbox, enc, f"{type(exc).__name__}: {exc}", fatal_path)
        code = 1
    outbox.close(linger=2000)
    inbox.close(linger=0)
    os._exit(code)


def _say_fatal(outbox, enc, reason: str, fatal_path: Optional[str]) -> None:
    """Why the core stops for good: in the file the frontend reads when it sees the exit, and as a message."""
    if fatal_path is not None:
        try:
            with open(fatal_path, "w") as f:
                f.write(reason)
        except OSError:
            pass
    try:
        outbox.send(enc.encode(wire.Fatal(reason)))
    except Exception:
        pass


class EngineCoreLoop:
    """The busy loop: while requests are in the engine, apply what arrived and step; idle, wait for a message."""

    def __init__(self, config: EngineConfig, inbox, outbox, enc, fatal_path: Optional[str] = None) -> None:
        from engine.llm_engine import LLMEngine

        self.engine = LLMEngine(config, detokenize_all=False)  # the API server decodes the rest (OutputAssembler)
        self.inbox, self.outbox, self.enc, self.fatal_path = inbox, outbox, enc, fatal_path
        hook = os.environ.get(FAULT_INJECTOR_ENV)
        if hook:
            module, _, factory = hook.partition(":")
            self.engine.fault_injector = getattr(importlib.import_module(module), factory)(self.engine)
            logger.warning("test hook %s=%s: faults are injected into this engine core", FAULT_INJECTOR_ENV, hook)
        self.dec = wire.decoder(wire.ToCore)
        self.deltas = OutputDeltas()
        self.engine.output_builder = self.deltas.build  # step() reports its outputs as wire.Deltas
        self._grammar_pool: Optional[ThreadPoolExecutor] = None
        self._compiling: set[str] = set()  # requests whose grammar compiles in the pool (an abort takes its id out)
        self._compiled: queue.SimpleQueue = queue.SimpleQueue()  # (the add's arguments, grammar or exception)
        self._adds = 0  # "add" messages taken (a "fail" says how many: core_client.py tells a lost request by it)
        vocab = min(len(self.engine.tokenizer), int(self.engine.hf_config.vocab_size))
        self._send(wire.Ready(self.engine.config, vocab))

    def _send(self, msg: wire.FromCore) -> None:
        self.outbox.send(self.enc.encode(msg), copy=False)

    def run(self) -> int:
        from engine.faults import StepError
        from engine.worker.tp_workers import TensorParallelError

        engine = self.engine
        # Under tensor parallelism an idle loop looks at the ranks now and then: one that died ends the core at
        # once, not at the next request's step (a watcher thread sees the exit; the loop acts on it).
        idle_ms = None if engine.workers is None else _RANK_POLL_MS
        while True:
            self._add_compiled()
            busy = engine.has_unfinished_requests()
            # Idle: wait for the next message (or, while a grammar compiles, look again soon); busy: take what has
            # arrived and step.
            while self.inbox.poll(0 if busy else _COMPILE_POLL_MS if self._compiling else idle_ms):
                if not self._handle(self.dec.decode(self.inbox.recv(copy=False))):
                    if self._grammar_pool is not None:
                        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
                    engine.shutdown(graceful=True)
                    return 0
                busy = engine.has_unfinished_requests()
            try:
                if engine.workers is not None:
                    engine.workers.check()
                if not busy:
                    continue
                outputs = engine.step()
            except StepError as exc:
                held = sorted(engine.request_ids() | self._compiling)
                self._send(wire.Fail(exc.stage, wire.Error.of(exc.cause), exc.request_ids, held, self._adds,
                                     exc.outputs, engine.get_stats()))
                self.deltas.forget(exc.request_ids)
                continue
            except TensorParallelError as exc:
                _say_fatal(self.outbox, self.enc, str(exc), self.fatal_path)
                engine.shutdown(graceful=False)
                return 1
            self._send(wire.Out(outputs, engine.get_stats()))

    def _add(self, args: tuple, grammar: Any) -> None:
        request_id = args[0]
        try:
            self.engine.add_request(*args, grammar=grammar)
        except Exception as exc:  # this request alone (the frontend checked its input already)
            self.engine.abort_request(request_id)  # whatever of it got into a queue
            self._send(wire.Refused(request_id, wire.Error.of(exc)))

    def _compile(self, args: tuple) -> None:  # in the grammar thread
        try:
            grammar = self.engine.structured.compile(args[3].guided)
        except Exception as exc:  # GrammarError: refused as add_request would refuse it
            grammar = exc
        self._compiled.put((args, grammar))

    def _add_compiled(self) -> None:
        """Add the requests whose grammar is ready (not those aborted while it compiled)."""
        while True:
            try:
                args, grammar = self._compiled.get_nowait()
            except queue.Empty:
                return
            if args[0] not in self._compiling:
                continue
            self._compiling.discard(args[0])
            if isinstance(grammar, Exception):
                self._send(wire.Refused(args[0], wire.Error.of(grammar)))
            else:
                self._add(args, grammar)

    def _handle(self, msg: wire.ToCore) -> bool:
        """Apply one message; False for Stop."""
        from engine.sampling_params import SamplingParams

        engine = self.engine
        if isinstance(msg, wire.Add):
            self._adds += 1
            try:
                params = msgspec.msgpack.decode(msg.params, type=SamplingParams)
                args = (msg.request_id, msg.prompt, msg.prompt_token_ids, params, msg.arrival_time, msg.priority)
                compile_first = params.guided is not None and engine.structured.cached(params.guided) is None
            except Exception as exc:  # this request alone (params that no longer validate: a ValidationError)
                self._send(wire.Refused(msg.request_id, wire.Error.of(exc)))
                return True
            if compile_first:
                if self._grammar_pool is None:
                    self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="core-grammar")
                self._compiling.add(msg.request_id)
                self._grammar_pool.submit(self._compile, args)
            else:
                self._add(args, None)
        elif isinstance(msg, wire.Abort):
            self._compiling.difference_update(msg.request_ids)
            engine.abort_request(msg.request_ids)
            self.deltas.forget(msg.request_ids)
            self._send(wire.Aborted(engine.get_stats()))
        elif isinstance(msg, wire.Reset):
            dropped = engine.reset() + sorted(self._compiling)
            self._compiling.clear()
            self.deltas.clear()
            self._send(wire.ResetDone(dropped, engine.get_stats()))
        elif isinstance(msg, wire.AskStats):
            self._send(wire.Stats(engine.get_stats()))
        elif isinstance(msg, wire.AskProblems):
            self._send(wire.Problems(engine.block_problems()))
        elif isinstance(msg, wire.Stop):
            return False
        return True


def spawn(config: EngineConfig, in_addr: str, out_addr: str, fatal_path: Optional[str] = None) -> Any:
    """Start the core process (multiprocessing spawn: a fresh interpreter, no inherited threads or locks). Not a
    daemon: under tensor parallelism it starts the other ranks, which a daemonic process may not."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=core_main, args=(config, in_addr, out_addr, os.getpid(), fatal_path),
                       name="engine-core", daemon=False)
    proc.start()
    return proc


if __name__ == "__main__":  # pragma: no cover
    sys.exit("engine/core_proc.py runs as the server's spawned engine core (pagedserve serve --engine-process)")
