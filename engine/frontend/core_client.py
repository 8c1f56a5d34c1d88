"""RemoteEngineCore: the EngineCore protocol (engine/frontend/protocol.py) over ZMQ, for an engine running in a process of
its own (engine/core_proc.py). AsyncLLMEngine drives it as it drives an in-process LLMEngine: its step thread
waits in step() for the core's next message (the GIL released), so the API server's event loop no longer shares
the GIL with the model, the sampler and the output processing.

    core = RemoteEngineCore.start(config)       # spawns the core, waits for it to load the model
    engine = AsyncLLMEngine(core)               # the server's EngineClient, as before

If the core process exits, a watch thread calls on_fatal at once: AsyncLLMEngine fails the requests in flight,
/health answers 503 and `pagedserve serve` exits with status 1 for its supervisor (docs/reliability.md).
"""
from __future__ import annotations

import collections
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import msgspec
import zmq

from engine import core_proc, wire
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer, engine_reads_text
from engine.faults import ADMISSION, StepError
from engine.metrics import EngineStats
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput

logger = logging.getLogger(__name__)

_POLL_MS = 100  # step() returns None after this long without a message (the caller checks its queue)
_START_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 15.0
# The most get_stats waits for figures it asked for: a core in a long prefill (or a hung collective) answers only
# when its step ends, and the step thread must come back to its queue (the last figures serve meanwhile).
_STATS_TIMEOUT_S = 1.0
_CLOSE_WAIT_S = 2.0  # shutdown from another thread: how long it waits for the step thread to leave the sockets


class EngineCoreDiedError(RuntimeError):
    """The engine core process exited: no request can be served by this server any more."""


_REMOTE_ERRORS: dict[tuple[str, bool], type] = {}


def _remote_error(error: wire.Error) -> BaseException:
    """The core's error as an exception named as the core's was (the client reads "<type>: <message>", as in one
    process); bad input (wire.Error) is a ValueError here: a 400, as in one process."""
    key = (error.type_name, error.bad_input)
    cls = _REMOTE_ERRORS.get(key)
    if cls is None:
        cls = _REMOTE_ERRORS[key] = type(error.type_name, (ValueError if error.bad_input else RuntimeError,), {})
    return cls(error.message)


class RemoteEngineCore:
    """The API server's handle on the engine core process: requests and aborts out, each step's outputs in.

    Its sockets are used by one thread at a time (the step thread; the loop only while no step runs) and never
    waited on for good: every wait is a poll of at most _POLL_MS under `_io`, after which a core that died or a
    shutdown ends it, so a shutdown from another thread takes `_io` before it closes them."""

    def __init__(self, config: EngineConfig, proc, ctx: zmq.Context, outbox, inbox, ready: wire.Ready,
                 folder) -> None:
        self.proc, self._ctx, self._outbox, self._inbox, self._folder = proc, ctx, outbox, inbox, folder
        self._enc, self._dec = wire.encoder(), wire.decoder(wire.FromCore)
        self._io = threading.Lock()  # held around each use of the sockets
        self._closed = False
        self.config, self.vocab_size = ready.config, ready.vocab_size
        from engine.model_executor.loader import _source, load_tokenizer

        source = _source(self.config)
        self.hf_config = source.hf_config
        self.tokenizer = load_tokenizer(source)
        self.eos_token_id = self.tokenizer.eos_token_id
        # each step's output deltas back into RequestOutputs, the text of most requests decoded here
        self._outputs = core_proc.OutputAssembler(Detokenizer(self.tokenizer))
        self._structured = None
        self._structured_lock = threading.Lock()
        # request id -> the number of its add among all adds sent: a fault's message says how many adds the core
        # had taken, so a request it took and no longer holds is known lost, one still on its way is not
        self._unfinished: dict[str, int] = {}
        self._adds = 0
        self._pending: collections.deque = collections.deque()  # messages read while waiting for a reply
        self._stats: Optional[EngineStats] = None
        self._stopping = False
        self.on_fatal: Optional[Callable[[BaseException], None]] = None
        self.dead_reason: Optional[str] = None
        threading.Thread(target=self._watch, name="core-watch", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig) -> "RemoteEngineCore":
        """Spawn the core and wait until it has loaded the model (its resolved config comes back)."""
        folder = tempfile.TemporaryDirectory(prefix="pagedserve-core-")
        in_addr, out_addr = (f"ipc://{Path(folder.name) / name}" for name in ("to-core", "from-core"))
        ctx = zmq.Context()
        outbox, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        outbox.bind(in_addr)
        inbox.bind(out_addr)
        proc = core_proc.spawn(config, in_addr, out_addr, str(Path(folder.name) / "fatal"))
        dec = wire.decoder(wire.FromCore)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if inbox.poll(200):
                msg = dec.decode(inbox.recv())
                if isinstance(msg, wire.Ready):
                    return cls(config, proc, ctx, outbox, inbox, msg, folder)
                if isinstance(msg, wire.Fatal):
                    proc.join(5)
                    raise ValueError(f"the engine core failed to start: {msg.reason}")
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the engine core did not start (exit code {proc.exitcode})")

    # ---- the EngineCore protocol -------------------------------------------------------------------------

    @property
    def structured(self) -> Any:
        """A grammar compiler in this process: specs are checked (a bad one is a 400) before they are sent; the
        core compiles its own copy from the spec."""
        if self._structured is None:
            with self._structured_lock:
                if self._structured is None:
                    from engine.structured_output.grammars import StructuredOutputs

                    self._structured = StructuredOutputs(self.tokenizer, int(self.hf_config.vocab_size),
                                                         self.eos_token_id,
                                                         int(self.config.grammar_cache_mb * 2**20))
        return self._structured

    def add_request(self, request_id: str, prompt: Optional[str] = None,
                    prompt_token_ids: Optional[list[int]] = None, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, priority: int = 0, grammar: Any = None) -> None:
        """Checked here as LLMEngine.add_request checks it (a ValueError for a bad prompt), then sent."""
        params = params if params is not None else SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt: either a prompt or prompt_token_ids is required.")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        if not prompt_token_ids:
            raise ValueError("prompt: the prompt is empty.")
        vocab = int(self.hf_config.vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is out of vocabulary (size {vocab}).")
        here = not engine_reads_text(params)
        if here:
            self._outputs.decode_text(request_id, params)
        try:
            self._send(wire.Add(request_id, prompt, list(prompt_token_ids), msgspec.Raw(self._enc.encode(params)),
                                arrival_time if arrival_time is not None else time.monotonic(), priority))
        except BaseException:  # not sent (the core died, the params do not encode): nothing of it is kept
            if here:
                self._outputs.forget([request_id])
            raise
        self._adds += 1
        self._unfinished[request_id] = self._adds

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> list:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._send(wire.Abort(ids))
        self._drop(ids)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def get_num_unfinished_requests(self) -> int:
        return len(self._unfinished)

    def request_ids(self) -> set[str]:
        return set(self._unfinished)

    def step(self) -> Optional[list[RequestOutput]]:
        """The core's next step: its outputs, or StepError naming the requests it ended; None when no step ended
        within _POLL_MS (no step to count: the caller applies what waits in its own queue, and polls again)."""
        msg = self._next(_POLL_MS)
        if msg is None:
            return None
        if isinstance(msg, wire.Out):
            return self._decode(msg.deltas, msg.stats)
        if isinstance(msg, wire.Fail):
            outputs = self._decode(msg.deltas, msg.stats)
            self._drop(msg.ended)
            # A fault may drop a request from the core's queues without naming it (half a schedule): one the core
            # had taken (its add among the first `adds`) and holds no more is lost, and no step will end it here.
            held = set(msg.held)
            self._drop([rid for rid, n in self._unfinished.items() if n <= msg.adds and rid not in held])
            raise StepError(msg.stage, _remote_error(msg.error), msg.ended, outputs)
        if isinstance(msg, wire.Refused):  # (AsyncLLMEngine fails that request alone, as an add that raised here)
            self._drop([msg.request_id])
            raise StepError(ADMISSION, _remote_error(msg.error), [msg.request_id])
        raise EngineCoreDiedError(f"the engine core stopped: {getattr(msg, 'reason', type(msg).__name__)}")

    def get_stats(self) -> EngineStats:
        """The core's latest figures: sent with each step; asked for when this side holds no request (aborts just
        sent are applied before the answer, so their freed blocks show), waiting at most _STATS_TIMEOUT_S once
        there are figures to fall back on (a late answer is taken in passing, as any figures)."""
        if (self._stats is None or not self._unfinished) and self.dead_reason is None and not self._stopping:
            reply = self._request(wire.AskStats(), wire.Stats, None if self._stats is None else _STATS_TIMEOUT_S)
            if reply is not None:
                self._stats = reply.stats
        elif not self._pending and self.dead_reason is None and not self._stopping:
            msg = self._next(0)  # (between runs of steps: the step thread is not reading)
            if msg is not None:
                self._pending.append(msg)
        return self._stats

    def block_problems(self) -> list[str]:
        return self._request(wire.AskProblems(), wire.Problems).problems

    def reset(self) -> list[str]:
        reply = self._request(wire.Reset(), wire.ResetDone)
        self._stats = reply.stats
        self._unfinished.clear()
        self._outputs.clear()
        # What the core sent before its reply is of the engine it reset (the steps it ran while the fault was
        # looked at): replayed, an output would be dropped anyway, and a "fail" would count as a new engine's fault.
        fatal = [msg for msg in self._pending if isinstance(msg, wire.Fatal)]
        self._pending.clear()
        self._pending.extend(fatal)
        return reply.dropped

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the core (graceful: it is told to; either way it is joined, and killed if it lingers), then close
        the sockets once no other thread is in one (a step thread stuck in a wait leaves within _POLL_MS)."""
        if self._stopping:
            return
        self._stopping = True
        if graceful and self.proc.is_alive():
            self._send_stop()
        self.proc.join(_STOP_TIMEOUT_S if graceful else 0.5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        if self._io.acquire(timeout=_CLOSE_WAIT_S):
            try:
                self._closed = True
                self._outbox.close(linger=0)
                self._inbox.close(linger=0)
                self._ctx.term()
            finally:
                self._io.release()
        else:  # (the process is ending; the sockets go with it)
            logger.warning("the engine core's sockets were left open: a thread is still in one")
        self._folder.cleanup()

    # ---- transport ------------------------------------------------------------------------------------------

    def _decode(self, deltas: list[wire.Delta], stats: EngineStats) -> list[RequestOutput]:
        """A step's output deltas as RequestOutputs (of the requests still in flight here), and its figures."""
        outputs = self._outputs.decode(deltas, self._unfinished)
        self._stats = stats
        for out in outputs:
            if out.finished:
                self._unfinished.pop(out.request_id, None)
        return outputs

    def _drop(self, request_ids: Iterable[str]) -> None:
        """Requests no longer in flight here (aborted, ended by a fault, refused, lost): nothing of them is kept."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            self._unfinished.pop(request_id, None)
        self._outputs.forget(request_ids)

    def _alive(self) -> None:
        """EngineCoreDiedError once the core is gone or being stopped: nothing waits on it past that."""
        if self.dead_reason is not None:
            raise EngineCoreDiedError(self.dead_reason)
        if self._stopping:
            raise EngineCoreDiedError("the engine core is shutting down")

    def _send(self, msg: wire.ToCore) -> None:
        """Queue a message for the core, waiting while its queue is full. A plain send would wait for good once the
        core died (a PUSH socket with no peer blocks): each wait is a poll, after which a dead core raises."""
        data = self._enc.encode(msg)
        while True:
            with self._io:
                self._alive()
                try:
                    self._outbox.send(data, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    self._outbox.poll(_POLL_MS, zmq.POLLOUT)

    def _send_stop(self) -> None:
        """The "stop" message of a graceful shutdown, given up on after _STOP_TIMEOUT_S (the core is then killed)."""
        data, deadline = self._enc.encode(wire.Stop()), time.monotonic() + _STOP_TIMEOUT_S
        while self.dead_reason is None and time.monotonic() < deadline:
            with self._io:
                try:
                    self._outbox.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    self._outbox.poll(_POLL_MS, zmq.POLLOUT)

    def _recv(self, timeout_ms: int) -> Optional[wire.FromCore]:
        """The next message, None after timeout_ms without one."""
        with self._io:
            if self._closed:
                raise EngineCoreDiedError("the engine core was shut down")
            if not self._inbox.poll(timeout_ms):
                return None
            return self._dec.decode(self._inbox.recv(copy=False))

    def _next(self, timeout_ms: int) -> Optional[wire.FromCore]:
        """The next message of a step (figures are taken in passing), None after timeout_ms without one.
        Only one thread at a time reads the socket: the step thread, or the loop while no step runs."""
        if self._pending:
            return self._pending.popleft()
        while True:
            msg = self._recv(timeout_ms)
            if msg is None:
                break
            if not isinstance(msg, wire.FIGURES):
                return msg
            self._stats = msg.stats
            timeout_ms = 0
        self._alive()
        return None

    def _request(self, msg: wire.ToCore, reply: type, timeout_s: Optional[float] = None) -> Any:
        """Send and wait for the reply (None after timeout_s without it); messages of steps that arrive first are
        kept for step()."""
        self._send(msg)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_ms = _POLL_MS if deadline is None else int(1000 * (deadline - time.monotonic()))
            if wait_ms <= 0:
                return None
            got = self._recv(min(wait_ms, _POLL_MS))
            if got is None:
                self._alive()
                continue
            if isinstance(got, reply):
                return got
            if isinstance(got, wire.FIGURES):  # an abort's figures, or a late answer to an ask that gave up
                self._stats = got.stats
                continue
            if isinstance(got, wire.Fatal):
                raise EngineCoreDiedError(f"the engine core stopped: {got.reason}")
            self._pending.append(got)

    def _watch(self) -> None:
        """The core's exit is seen at once (its process sentinel): the engine is dead unless we stopped it."""
        from multiprocessing.connection import wait

        wait([self.proc.sentinel])
        if self._stopping:
            return
        self.proc.join(1.0)  # (its exit code)
        try:  # why, when the core could say it (it also sends it, but the step thread may not be reading)
            why = (Path(self._folder.name) / "fatal").read_text()
        except OSError:
            why = None
        self.dead_reason = (f"the engine core stopped: {why}" if why else
                            f"the engine core process exited (exit code {self.proc.exitcode})")
        logger.error("%s", self.dead_reason)
        if self.on_fatal is not None:
            self.on_fatal(EngineCoreDiedError(self.dead_reason))
