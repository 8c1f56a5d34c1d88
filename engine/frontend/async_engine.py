"""AsyncLLMEngine: one background task drives LLMEngine.step() (runs of steps in one thread); each request reads
its own stream."""
from __future__ import annotations

import asyncio
import collections
import enum
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from engine.faults import ADMISSION, StepError
from engine.platform.memory import find_malloc_trim
from engine.config import EngineConfig
from engine.metrics import EngineStats, Metrics, StatLogger
from engine.frontend.protocol import EngineCore
from engine.sampling_params import GuidedSpec, SamplingParams
from engine.sequence import RequestOutput

logger = logging.getLogger(__name__)

# glibc keeps the pages of freed tensors of ever-new sizes in its arenas (docs/reliability.md); malloc_trim
# hands them back. A few ms in the step thread, between steps, every this many seconds.
TRIM_INTERVAL_S = 10.0
# A fault in two steps in a row resets the engine; more than MAX_RESETS resets within RESET_WINDOW_S means the
# fault outlives a reset (the model, the device): the engine stops and /health stays 503 for the supervisor.
MAX_RESETS = 3
RESET_WINDOW_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine loop stopped (resets did not help, or shutdown); no request can be served."""


class EngineResetError(EngineDeadError):
    """The request was in flight when the engine reset after a fault (a 503: retry it)."""


class RequestFailedError(RuntimeError):
    """A step running this request raised (a 500); the engine goes on serving the others."""


@dataclass
class _Fault:
    """A step that raised, as the step thread hands it to the loop."""

    error: StepError
    problems: list[str]  # broken block invariants
    reset: bool
    dropped: list[str]  # requests in flight that the reset ended
    known: set[str]  # the requests the engine still holds after the fault


class _Op(enum.Enum):
    ADD = enum.auto()
    ABORT = enum.auto()


class _RequestStream:
    """The outputs of one request id, handed from the engine loop to its reader (both on the event loop).

    A RequestOutput holds all of its request's text, tokens and logprobs so far, so an output its reader has not
    taken yet is replaced by the next one (vLLM V1's output collector does the same): a reader that fell behind,
    a stream whose client reads slowly or an event loop busy with 256 streams, takes one output, one SSE event,
    for what several steps made, instead of falling further behind by one event a step. Errors, the end (None)
    and a finished output are never replaced."""

    def __init__(self, request_id: str, params: Optional[SamplingParams] = None) -> None:
        self.request_id = request_id
        self.params = params  # (its n and max_tokens go to /metrics when it finishes)
        self._items: collections.deque[Union[RequestOutput, BaseException, None]] = collections.deque()
        self._ready = asyncio.Event()
        self.finished = False
        self.merged = 0  # outputs a newer one replaced before the reader took them

    def put(self, item: Union[RequestOutput, BaseException]) -> None:
        if not self.finished:
            self._push(item)

    def finish(self, item: Union[RequestOutput, BaseException, None] = None) -> None:
        if item is not None:
            self.put(item)
        if not self.finished:
            self.finished = True
            self._push(None)

    def _push(self, item: Union[RequestOutput, BaseException, None]) -> None:
        items = self._items
        if (items and isinstance(item, RequestOutput) and isinstance(items[-1], RequestOutput)
                and not items[-1].finished):
            items[-1] = item
            self.merged += 1
        else:
            items.append(item)
        self._ready.set()

    async def get(self) -> Union[RequestOutput, BaseException, None]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class AsyncLLMEngine:
    """Async front of an LLMEngine: requests and aborts go through a queue to one loop task."""

    def __init__(
        self, engine: EngineCore, *, log_stats: bool = True, stats_interval_s: float = 5.0, step_thread_nice: int = 5,
        step_executor: Optional[ThreadPoolExecutor] = None,
    ) -> None:
        self.engine = engine  # only the loop task (and its executor thread) touches it
        self.metrics = Metrics(engine.config.model_name)
        self.stat_logger = StatLogger(stats_interval_s) if log_stats else None
        self._stats = engine.get_stats()
        self.metrics.set_cache_config(self._stats)
        self._streams: dict[str, _RequestStream] = {}
        self._queue: Optional[asyncio.Queue] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None
        # The one thread that computes; from_config also builds the engine in it (see there).
        self._executor = step_executor or _step_executor(step_thread_nice)
        # Grammars compile here, one at a time, off the event loop and off the step thread (a compile takes from
        # a millisecond to seconds, superlinear in the schema); the engine's compiler is built here on first use.
        self._grammar_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile",
                                                    initializer=_lower_priority, initargs=(step_thread_nice,))
        self._structured: Any = None  # the engine's StructuredOutputs once the grammar thread has built it
        self._dead: Optional[BaseException] = None
        self._resetting = False
        # steps that raised since the last one that did not (idle time between them too; a remote core's poll that
        # no step ended within is no step)
        self._fault_streak = 0
        self._reset_times: list[float] = []
        self._adding: set[str] = set()  # requests queued to the loop, not yet in the engine
        # Called (on the loop) when the engine stops for good; the CLI ends the process so a supervisor restarts it.
        self.on_dead: Optional[Callable[[], None]] = None
        self._parked = False  # the loop waits for work: the engine holds no request and no step runs
        self._halt_steps = False  # the loop task stopped: a run of steps in the step thread ends after its step
        self._accepting = True
        self._cut_handle: Optional[asyncio.TimerHandle] = None  # ends what is left at the shutdown deadline
        self._malloc_trim = find_malloc_trim()
        self._last_trim = time.monotonic()
        self.num_cut_at_shutdown = 0
        if hasattr(engine, "on_fatal"):  # a tensor-parallel rank that dies between steps stops the engine at once
            engine.on_fatal = self._fatal_from_thread

    @classmethod
    def from_config(cls, config: EngineConfig, *, step_thread_nice: int = 5, **kwargs: Any) -> "AsyncLLMEngine":
        """Build the engine in the step thread, the thread every step then runs in. libgomp keeps a pool of OpenMP
        workers per thread that opened a parallel region, and once it manages more threads than there are cores it
        cuts their spinning (GOMP_SPINCOUNT, server/cli.py) to ~1000 iterations: loaded in the main thread, the
        engine left that thread's pool behind, and with spinning workers a decode step at batch 1 took 39.5 ms
        instead of 24.5 (float32, 2 cores; docs/benchmarks.md "OpenMP threads")."""
        from engine.llm_engine import LLMEngine

        executor = _step_executor(step_thread_nice)
        try:
            engine = executor.submit(LLMEngine, config).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, step_thread_nice=step_thread_nice, step_executor=executor, **kwargs)

    # -- read-only views (safe from the event loop: no engine state is touched) --
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: both the model's embedding and the tokenizer must know them."""
        sizes = [len(self.engine.tokenizer)]
        model_vocab = getattr(getattr(self.engine, "hf_config", None), "vocab_size", None)
        if model_vocab:
            sizes.append(int(model_vocab))
        return min(sizes)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def is_ready(self) -> bool:
        """True when a new request would be served (for /health)."""
        return self._dead is None and self._accepting and not self._resetting

    @property
    def unavailable_reason(self) -> str:
        """Why a new request is refused (when not is_ready), for the 503 body."""
        if self._dead is not None:
            return f"The engine has died: {self._dead!r}."
        if not self._accepting:
            return "The server is shutting down."
        if self._resetting:
            return "The engine is resetting after a fault; retry shortly."
        return "The engine is not ready."

    def get_stats(self) -> EngineStats:
        """The EngineStats after the latest step (a snapshot; the engine itself is not read here)."""
        return self._stats

    # -- lifecycle --
    def start(self) -> None:
        """Start the loop task on the running event loop (idempotent)."""
        if self._task is not None and not self._task.done():
            return
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}")
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._halt_steps = False
        self._task = self._loop.create_task(self._run_loop(), name="engine-loop")

    def begin_shutdown(self, timeout_s: float) -> None:
        """Refuse new requests from now on; whatever is still in flight after timeout_s ends with
        EngineDeadError (the server answers 503) and is aborted in the engine. Idempotent; any thread,
        a signal handler included."""
        self._accepting = False
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._arm_cut, timeout_s)

    def _arm_cut(self, timeout_s: float) -> None:
        if self._cut_handle is None:
            self._cut_handle = asyncio.get_running_loop().call_later(timeout_s, self._cut_in_flight, timeout_s)

    def _cut_in_flight(self, timeout_s: float) -> None:
        """The shutdown deadline: every reader gets the error, the engine aborts their requests (blocks freed)."""
        streams, self._streams = self._streams, {}
        exc = EngineDeadError(f"The server is shutting down: the request was still running {timeout_s:g} s after "
                              "the signal (--shutdown-timeout). Retry it.")
        for request_id, stream in streams.items():
            stream.finish(exc)
            if self._queue is not None:
                self._queue.put_nowait((_Op.ABORT, request_id, None))
        self.num_cut_at_shutdown += len(streams)
        if streams:
            logger.warning("shutdown timeout (%g s): ended %d request(s) still in flight", timeout_s, len(streams))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish within timeout_s, end and abort the rest, stop the loop."""
        self.begin_shutdown(timeout_s)
        loop = asyncio.get_running_loop()
        while self._streams and self.is_running:
            await asyncio.sleep(0.05)  # the cut at the deadline empties _streams
        # The aborts reach the engine once the step in progress returns; then no block is held. Only the loop
        # reads the engine (a step may be running in the executor thread): wait for it to park, idle.
        deadline = loop.time() + 10.0
        while self.is_running and not (self._parked and self._queue.empty()):
            if loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._cut_handle is not None:
            self._cut_handle.cancel()
        self._fail_all(EngineDeadError("server is shutting down"))
        await self._stop_engine()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._grammar_executor.shutdown(wait=False, cancel_futures=True)
        if self._dead is None:
            stats = self._stats  # the loop's latest snapshot: a cancelled step may still be running
            logger.info("engine stopped: %d request(s) ended at the shutdown timeout, %d left in the engine, "
                        "KV cache usage %.1f%%", self.num_cut_at_shutdown,
                        stats.num_running + stats.num_waiting + stats.num_swapped, 100 * stats.device_cache_usage)

    async def _stop_engine(self, timeout_s: float = 15.0) -> None:
        """Stop the engine's other ranks (tensor parallelism) in the step thread, after any step still running:
        neither the stop message nor the group's teardown may cross a step's collectives (a dead engine's too:
        its last step may still be in one). Forcibly, from here, when that takes longer than timeout_s."""
        close = getattr(self.engine, "shutdown", None)
        if close is None:
            return
        graceful = self._dead is None  # a dead engine's ranks get no stop message
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                self._executor, lambda: close(graceful=graceful)), timeout_s)
            return
        except Exception as exc:  # a step stuck in a collective, or the stop failed: end the ranks anyway
            logger.error("the engine did not stop cleanly (%r); ending its ranks", exc)
        close(graceful=False)

    def _fatal_from_thread(self, exc: BaseException) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._die, exc)
        else:
            self._dead = exc

    def _die(self, exc: BaseException) -> None:
        """On the loop: the engine cannot serve again. Every reader gets the error, /health turns 503, and the
        CLI's on_dead ends the process for its supervisor to restart."""
        if self._dead is not None:
            return
        self._dead = exc
        self._fail_all(EngineDeadError(f"The engine stopped: {exc}"))
        if self.on_dead is not None:
            self.on_dead()

    # -- requests --
    async def generate(
        self,
        request_id: str,
        prompt: Optional[str] = None,
        prompt_token_ids: Optional[list[int]] = None,
        params: Optional[SamplingParams] = None,
        priority: int = 0,
        grammar: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its RequestOutputs until the finished one; aborts if left early.
        `grammar`: params.guided as compile_grammar returned it; None: compiled here (in the grammar thread)."""
        if grammar is None and params is not None and params.guided is not None:
            grammar = await self.compile_grammar(params.guided)
        stream = self.add_request(request_id, prompt, prompt_token_ids, params, priority, grammar)
        try:
            while True:
                item = await stream.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished or request_id in self._streams:
                self.abort(request_id)

    async def compile_grammar(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of a structured-output spec: from the cache, else compiled in the grammar thread,
        so neither the event loop nor a step waits for a compile. GrammarError (a ValueError) if invalid."""
        if self._structured is not None:
            compiled = self._structured.cached(spec)  # a cached spec costs no thread hop (it would cost a GIL switch)
            if compiled is not None:
                return compiled
        return await asyncio.get_running_loop().run_in_executor(self._grammar_executor, self._compile, spec)

    def _compile(self, spec: GuidedSpec) -> Any:
        """In the grammar thread. The first call builds the engine's compiler (xgrammar reads the whole
        vocabulary: ~0.2 s for SmolLM2's)."""
        self._structured = self.engine.structured
        return self._structured.compile(spec)

    def add_request(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: Optional[list[int]],
        params: Optional[SamplingParams],
        priority: int = 0,
        grammar: Any = None,
    ) -> _RequestStream:
        """Queue a request for the engine (the step thread admits it); `grammar` is params.guided compiled."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}")
        if not self._accepting:
            raise EngineDeadError("server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        self.start()
        stream = _RequestStream(request_id, params)
        self._streams[request_id] = stream
        self._adding.add(request_id)
        self._queue.put_nowait((_Op.ADD, request_id, (prompt, prompt_token_ids, params, priority, grammar)))
        return stream

    def abort(self, request_id: Union[str, list[str]]) -> None:
        """Abort requests wherever they are (queued, running, swapped); callable from any thread."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._abort_on_loop(ids)
        else:
            loop.call_soon_threadsafe(self._abort_on_loop, ids)

    def _abort_on_loop(self, ids: list[str]) -> None:
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.finish()
                if self._queue is not None:
                    self._queue.put_nowait((_Op.ABORT, rid, None))

    # -- the loop --
    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                ops = []
                if not self.engine.has_unfinished_requests() and self._queue.empty():
                    await self._refresh_stats()
                    self._parked = True  # idle: sleep until a request or abort arrives
                    ops.append(await self._queue.get())
                    self._parked = False
                while not self._queue.empty():
                    ops.append(self._queue.get_nowait())
                ops = [op for op in ops if self._still_wanted(op)]
                self._deliver(*await loop.run_in_executor(self._executor, self._run_steps, loop, ops))
        except asyncio.CancelledError:
            self._halt_steps = True
            raise
        except BaseException as exc:  # outside a step, or resets did not help: stop serving
            logger.exception("the engine loop failed; the engine is dead")
            self._die(exc)

    def _run_steps(self, loop: asyncio.AbstractEventLoop, ops: list[tuple]
                   ) -> tuple[list[RequestOutput], EngineStats, Optional[_Fault]]:
        """In the step thread: the queued adds and aborts (`ops`), then steps back to back while no add or abort
        waits in the queue. Each step's outputs but
        the last go to the loop as they come, which streams them while the next step computes (the forward
        releases the GIL). Handing every step back to the loop instead put a round trip between steps (the
        future's wake-up, the dispatch, the readers' SSE writes, the executor's wake-up and the GIL): 0.6-1.0 ms
        a step at one stream and ~2.6 ms at 32 on a 2-core Zen 4 (docs/benchmarks.md, "Back-to-back steps").
        The run ends after a step that raised, when the engine holds no request, when an op waits (the next run
        applies it first, between two steps as before), or when the loop stopped."""
        refused = self._apply(ops)
        if refused:
            try:
                loop.call_soon_threadsafe(self._refuse, refused)  # before any output of the run reaches the loop
            except RuntimeError:  # the loop closed: nothing reads them any more
                pass
        if not self.engine.has_unfinished_requests():
            return [], self.engine.get_stats(), None
        while True:
            outputs, stats, fault = self._step()
            # qsize() is a deque's length, read here while the loop may append: safe under the GIL, and a put
            # that lands just after the read waits one step more, as it would have waited for this one.
            if (fault is not None or self._halt_steps or self._dead is not None or self._queue.qsize()
                    or not self.engine.has_unfinished_requests()):
                return outputs, stats, fault
            try:
                loop.call_soon_threadsafe(self._deliver, outputs, stats, None)
            except RuntimeError:  # the loop closed under the run: nothing reads the outputs any more
                return outputs, stats, fault

    def _deliver(self, outputs: list[RequestOutput], stats: EngineStats, fault: Optional[_Fault]) -> None:
        """On the loop: a step's outputs to their readers, its fault (if it raised) to the requests it cost."""
        self._stats = stats
        self._dispatch(outputs)
        if fault is not None:
            self._fail_requests(fault)
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(stats)

    def _step(self) -> tuple[list[RequestOutput], EngineStats, Optional[_Fault]]:
        """Runs in the executor thread: the only place the engine computes. A step that raised has ended its
        requests; when the block invariants no longer hold or the previous step raised too, reset the engine."""
        try:
            outputs = self.engine.step()
        except StepError as err:
            if err.stage == ADMISSION:  # an engine core in its own process refused an add (core_client.py): that
                # request alone, as _apply fails one here; no step raised, so no fault streak and no reset
                refused = [(rid, self._admission_error(rid, err.cause)) for rid in err.request_ids]
                try:
                    self._loop.call_soon_threadsafe(self._refuse, refused)
                except RuntimeError:  # the loop closed: nothing reads them any more
                    pass
                return err.outputs, self.engine.get_stats(), None
            self._fault_streak += 1
            problems = self.engine.block_problems()
            reset = bool(problems) or self._fault_streak > 1
            dropped = self._reset() if reset else []
            return err.outputs, self.engine.get_stats(), _Fault(err, problems, reset, dropped,
                                                                     self.engine.request_ids())
        if outputs is None:  # an engine core in its own process ended no step within its poll: nothing to count
            outputs = []
        else:
            self._fault_streak = 0
        self._maybe_trim()
        return outputs, self.engine.get_stats(), None

    def _reset(self) -> list[str]:
        now = time.monotonic()
        self._reset_times = [t for t in self._reset_times if now - t < RESET_WINDOW_S] + [now]
        if len(self._reset_times) > MAX_RESETS:
            raise EngineDeadError(f"{len(self._reset_times)} engine resets within {RESET_WINDOW_S:g} s did not "
                                  "clear the fault")
        self._resetting = True  # /health answers 503 until the new cache is there
        try:
            dropped = self.engine.reset()
        finally:
            self._resetting = False
        self._fault_streak = 0
        return dropped

    def _fail_requests(self, fault: _Fault) -> None:
        """On the loop: the failed step's readers get a 500, a reset's in-flight readers a 503; counted, logged."""
        err = fault.error
        logger.error("engine step failed in %s: %s: %s; ending request(s) %s", err.stage, type(err.cause).__name__,
                     err.cause, ", ".join(err.request_ids) or "(none)", exc_info=err.cause)
        failed = RequestFailedError(err.client_message())
        self._end_streams(err.request_ids, failed, "step_fault")
        if fault.problems:
            logger.error("block manager invariants broken after the fault: %s", "; ".join(fault.problems))
        if fault.reset:
            self.metrics.engine_resets.labels(self.metrics.model_name).inc()
            logger.error("engine reset (scheduler, block manager and KV cache rebuilt); ending in-flight "
                         "request(s) %s", ", ".join(fault.dropped) or "(none)")
            self._end_streams(fault.dropped, EngineResetError(
                "The engine was reset after a fault while this request was in flight; retry it."), "engine_reset")
        # A fault inside the scheduler may drop a request from every queue: its reader must not wait forever.
        lost = [rid for rid in self._streams if rid not in fault.known and rid not in self._adding]
        if lost:
            logger.error("request(s) %s left the engine's queues in the fault; ending them", ", ".join(lost))
            self._end_streams(lost, failed, "step_fault")

    def _end_streams(self, request_ids: list[str], exc: BaseException, reason: str) -> None:
        for rid in request_ids:
            self.metrics.request_failures.labels(self.metrics.model_name, reason).inc()
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.finish(exc)

    def _maybe_trim(self) -> None:
        """In the step thread: give freed heap pages back to the OS at most every TRIM_INTERVAL_S."""
        now = time.monotonic()
        if self._malloc_trim is not None and now - self._last_trim >= TRIM_INTERVAL_S:
            self._last_trim = now
            self._malloc_trim(0)

    async def _refresh_stats(self) -> None:
        """Idle: the engine's figures, asked for in the step thread (an engine core in its own process answers
        between its steps: the event loop, /health and new connections, must not wait for a long prefill), and the
        heap trimmed there."""
        self._stats = await asyncio.get_running_loop().run_in_executor(self._executor, self._idle_stats)
        self.metrics.record_stats(self._stats)

    def _idle_stats(self) -> EngineStats:
        self._maybe_trim()
        return self.engine.get_stats()

    def _still_wanted(self, op: tuple) -> bool:
        """On the loop: False for an add whose reader aborted before it reached the engine."""
        kind, request_id, _ = op
        if kind is _Op.ADD:
            self._adding.discard(request_id)
            return request_id in self._streams
        return True

    def _apply(self, ops: list[tuple]) -> list[tuple[str, BaseException]]:
        """In the step thread: adds and aborts in their order. Whatever a request's admission raises fails that
        request alone (a ValueError: its input is bad, a 400; anything else a 500) and the engine goes on."""
        refused = []
        for kind, request_id, payload in ops:
            if kind is _Op.ABORT:
                self.engine.abort_request(request_id)
                continue
            prompt, prompt_token_ids, params, priority, grammar = payload
            try:
                self.engine.add_request(request_id, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params,
                                        priority=priority, grammar=grammar)
            except Exception as exc:
                if not isinstance(exc, ValueError):
                    self.engine.abort_request(request_id)  # whatever of it got into a queue
                refused.append((request_id, self._admission_error(request_id, exc)))
        return refused

    @staticmethod
    def _admission_error(request_id: str, exc: BaseException) -> BaseException:
        """What the reader of a request whose admission raised gets: a ValueError as is (its input is bad, a 400),
        anything else a RequestFailedError (a 500), logged."""
        if isinstance(exc, ValueError):
            return exc
        logger.error("admitting request %s failed: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
        return RequestFailedError(f"The engine failed while admitting this request: {type(exc).__name__}: {exc}")

    def _refuse(self, refused: list[tuple[str, BaseException]]) -> None:
        """On the loop: the readers of requests whose admission raised get the error."""
        for request_id, exc in refused:
            if isinstance(exc, RequestFailedError):
                self.metrics.request_failures.labels(self.metrics.model_name, "admission_fault").inc()
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.finish(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        self.metrics.record_stats(self._stats)
        for out in outputs:
            if out.finished:
                stream = self._streams.pop(out.request_id, None)
                self.metrics.record_finished(out, stream.params if stream is not None else None)
                if stream is not None:
                    stream.finish(out)
            else:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.finish(exc)
        self._adding.clear()
        if self._queue is not None:
            while not self._queue.empty():
                self._queue.get_nowait()

    def __repr__(self) -> str:
        state = "dead" if self._dead else ("running" if self.is_running else "idle")
        return f"AsyncLLMEngine({self.config.model_name!r}, {state}, {len(self._streams)} in flight)"


def _step_executor(nice: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step", initializer=_lower_priority,
                              initargs=(nice,))


def _lower_priority(nice: int) -> None:
    """Nice the step thread (and the OpenMP team it spawns): on a busy CPU the event loop, which answers
    /health and streams tokens, must not wait behind a forward."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # Linux: per-thread
    except OSError:
        pass
