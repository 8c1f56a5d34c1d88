"""The engine core in a process of its own: a busy loop (apply adds and aborts, step, send the step's outputs)
reached over ZMQ with msgpack (msgspec). The API-server process drives it through RemoteEngineCore
(engine/frontend/core_client.py), which AsyncLLMEngine uses as it uses an in-process LLMEngine.

Messages, one msgpack array each (the first item names it):
  frontend -> core: ("add", request_id, prompt, prompt_token_ids, params, arrival_time, priority)
                    ("abort", [request_id, ...]), ("stats",), ("reset",), ("problems",), ("stop",)
  core -> frontend: ("ready", config, vocab_size), ("out", [output delta, ...], stats) once per step,
                    ("fail", stage, error, [ended request_id, ...], [held request_id, ...], adds, [output delta, ...],
                    stats) for a StepError (held: the requests the core holds after it, adds: how many adds it had
                    taken), ("refused", request_id, error) for an add the engine refused,
                    ("stats", stats) answering "stats", ("aborted", stats) after an abort (figures the frontend takes
                    in passing), ("reset", [dropped request_id, ...], stats), ("problems", [str, ...]),
                    ("fatal", message)
An error is (type name, message, bad input): error_fields.
An output delta is a RequestOutput as what changed since the request's last one (OutputDeltas): the prompt, its ids
and prompt logprobs once, then per choice the text, token ids and logprobs each as (kept length, new items). A
RequestOutput holds the whole text and token ids so far: sent whole, a step at 256 streams of 128 tokens carried
256 prompts and ~16k token ids, and decoding it took the frontend's step thread ~20 % of a core (py-spy, 2 vCPU).
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
from typing import Any, Iterable, Optional

import msgspec
import zmq

from engine.config import EngineConfig
from engine.platform.parent import exit_with_parent
from engine.sequence import CompletionOutput, RequestMetrics, RequestOutput

logger = logging.getLogger(__name__)


_COMPILE_POLL_MS = 10  # idle but compiling: how often the loop looks for a compiled grammar
_RANK_POLL_MS = 100  # idle under tensor parallelism: how often the loop looks for a rank that died
FAULT_INJECTOR_ENV = "PAGEDSERVE_CORE_FAULT_INJECTOR"  # the test hook (see above)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder()


def error_fields(exc: BaseException) -> tuple[str, str, bool]:
    """An exception as it crosses to the frontend: its type's name, its message, and whether it is the request's
    bad input (a ValueError of any kind, or the params failing msgspec's validation), which the client gets as a
    400 as in one process."""
    return type(exc).__name__, str(exc), isinstance(exc, ValueError)  # (msgspec.ValidationError is one)


def _kept(new: Any, old: Any) -> int:
    """How much of `old` (a str or list) starts `new`: all of it in the usual step, which only appends."""
    n = len(old)
    if len(new) >= n and new[:n] == old:
        return n
    return next((i for i, (a, b) in enumerate(zip(new, old)) if a != b), min(n, len(new)))


class OutputDeltas:
    """The core's side of the output deltas: each RequestOutput as what changed since the request's last one.

    Per request it keeps the last text and token ids sent for each choice (the RequestOutput's own copies) until the
    request's final output, or until forget() (an abort, a failed step's ended requests) or a reset."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[Any, list[tuple[str, list[int], int]]]] = {}

    def encode(self, outputs: list[RequestOutput]) -> list[tuple]:
        items = []
        for out in outputs:
            prev = self._sent.get(out.request_id)
            resend = prev is None or prev[0] is not out.prompt_logprobs
            last = prev[1] if prev is not None else []
            choices, sent = [], []
            for j, c in enumerate(out.outputs):
                text, ids, num_lps = last[j] if j < len(last) else ("", [], 0)
                keep_text, keep_ids = _kept(c.text, text), _kept(c.token_ids, ids)
                keep_lps = min(keep_ids, num_lps) if c.logprobs is not None else 0
                choices.append((c.index, keep_text, c.text[keep_text:], keep_ids, c.token_ids[keep_ids:],
                                c.cumulative_logprob, keep_lps, None if c.logprobs is None else c.logprobs[keep_lps:],
                                c.finish_reason, c.stop_reason))
                sent.append((c.text, c.token_ids, 0 if c.logprobs is None else len(c.logprobs)))
            if out.finished:
                self._sent.pop(out.request_id, None)
            else:
                self._sent[out.request_id] = (out.prompt_logprobs, sent)
            prompt = (out.prompt, out.prompt_token_ids, out.prompt_logprobs) if resend else None
            items.append((out.request_id, prompt, out.finished, out.error, out.metrics, choices))
        return items

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
        # request id -> [(prompt, ids, prompt logprobs), each choice's [text, ids, logprobs, _Text], the metrics as
        # sent, their RequestMetrics (converted again only when they change: thrice in a request's life)]
        self._requests: dict[str, list] = {}
        self._pending: collections.deque = collections.deque()  # request ids to forget; None: forget all
        self._detokenizer = detokenizer
        # request id -> (skip_special_tokens, include_stop_str_in_output) of a request whose text is decoded here
        self._here: dict[str, tuple[bool, bool]] = {}

    def decode_text(self, request_id: str, params: Any) -> None:
        """Decode this request's text here (call before its add is sent, on the thread that calls decode)."""
        self._apply_pending()
        self._here[request_id] = (params.skip_special_tokens, params.include_stop_str_in_output)

    def decode(self, items: list, live: set[str]) -> list[RequestOutput]:
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

    def _decode(self, items: list, live: set[str]) -> list[RequestOutput]:
        outputs = []
        for request_id, prompt, finished, error, metrics, choices in items:
            if request_id not in live:
                self._requests.pop(request_id, None)
                self._here.pop(request_id, None)
                continue
            here = self._here.get(request_id)
            state = self._requests.get(request_id)
            if prompt is not None:
                state = [tuple(prompt), state[1] if state is not None else [], None, None]
            elif state is None:
                continue
            last = state[1]
            completions = []
            for j, (index, keep_text, text, keep_ids, ids, cumulative, keep_lps, lps, reason, stop) in enumerate(
                    choices):
                if j == len(last):
                    last.append(["", [], [], None])
                acc = last[j]
                if here is None:
                    acc[0] = (acc[0] if keep_text == len(acc[0]) else acc[0][:keep_text]) + text
                    del acc[1][keep_ids:]
                    acc[1].extend(ids)
                else:
                    del acc[1][keep_ids:]
                    acc[1].extend(ids)
                    acc[0] = self._text(acc, keep_ids, ids, reason, here, state[0][1])
                if lps is not None:
                    del acc[2][keep_lps:]
                    acc[2].extend(lps)  # (msgpack keeps the dicts' int keys)
                completions.append(CompletionOutput(index, acc[0], list(acc[1]), cumulative,
                                                    None if lps is None else list(acc[2]), reason, stop))
            del last[len(choices):]
            if finished:
                self._requests.pop(request_id, None)
                self._here.pop(request_id, None)
            else:
                self._requests[request_id] = state
            if metrics is not None and metrics != state[2]:
                state[2], state[3] = metrics, msgspec.convert(metrics, RequestMetrics)
            p, p_ids, p_lps = state[0]
            outputs.append(RequestOutput(request_id, p, p_ids, p_lps, completions, finished, error,
                                         None if metrics is None else state[3]))
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
    enc = encoder()
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
        outbox.send(enc.encode(("fatal", reason)))
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
        self.dec = decoder()
        self.deltas = OutputDeltas()
        self._grammar_pool: Optional[ThreadPoolExecutor] = None
        self._compiling: set[str] = set()  # requests whose grammar compiles in the pool (an abort takes its id out)
        self._compiled: queue.SimpleQueue = queue.SimpleQueue()  # (the add's arguments, grammar or exception)
        self._adds = 0  # "add" messages taken (a "fail" says how many: core_client.py tells a lost request by it)
        vocab = min(len(self.engine.tokenizer), int(self.engine.hf_config.vocab_size))
        self._send(("ready", msgspec.to_builtins(self.engine.config), vocab))

    def _send(self, msg: tuple) -> None:
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
                self._send(("fail", exc.stage, error_fields(exc.cause), exc.request_ids, held, self._adds,
                            self.deltas.encode(exc.outputs), engine.get_stats()))
                self.deltas.forget(exc.request_ids)
                continue
            except TensorParallelError as exc:
                _say_fatal(self.outbox, self.enc, str(exc), self.fatal_path)
                engine.shutdown(graceful=False)
                return 1
            self._send(("out", self.deltas.encode(outputs), engine.get_stats()))

    def _add(self, args: tuple, grammar: Any) -> None:
        request_id = args[0]
        try:
            self.engine.add_request(*args, grammar=grammar)
        except Exception as exc:  # this request alone (the frontend checked its input already)
            self.engine.abort_request(request_id)  # whatever of it got into a queue
            self._send(("refused", request_id, error_fields(exc)))

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
                self._send(("refused", args[0], error_fields(grammar)))
            else:
                self._add(args, grammar)

    def _handle(self, msg: list) -> bool:
        """Apply one message; False for "stop"."""
        from engine.sampling_params import SamplingParams

        kind = msg[0]
        engine = self.engine
        if kind == "add":
            self._adds += 1
            _, request_id, prompt, token_ids, params, arrival, priority = msg
            try:
                args = (request_id, prompt, token_ids, msgspec.convert(params, SamplingParams), arrival, priority)
                spec = args[3].guided
                compile_first = spec is not None and engine.structured.cached(spec) is None
            except Exception as exc:  # this request alone (params that no longer validate: a ValidationError)
                self._send(("refused", request_id, error_fields(exc)))
                return True
            if compile_first:
                if self._grammar_pool is None:
                    self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="core-grammar")
                self._compiling.add(request_id)
                self._grammar_pool.submit(self._compile, args)
            else:
                self._add(args, None)
        elif kind == "abort":
            self._compiling.difference_update(msg[1])
            engine.abort_request(msg[1])
            self.deltas.forget(msg[1])
            self._send(("aborted", engine.get_stats()))  # the freed blocks show in /metrics without a step
        elif kind == "reset":
            dropped = engine.reset() + sorted(self._compiling)
            self._compiling.clear()
            self.deltas.clear()
            self._send(("reset", dropped, engine.get_stats()))
        elif kind == "stats":
            self._send(("stats", engine.get_stats()))
        elif kind == "problems":
            self._send(("problems", engine.block_problems()))
        elif kind == "stop":
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
