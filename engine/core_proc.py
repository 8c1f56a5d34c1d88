"""The engine core in a process of its own: a busy loop (apply adds and aborts, step, send the step's outputs)
reached over ZMQ with msgpack (msgspec). The API-server process drives it through RemoteEngineCore
(engine/frontend/core_client.py), which AsyncLLMEngine uses as it uses an in-process LLMEngine.

Messages, one msgpack array each (the first item names it):
  frontend -> core: ("add", request_id, prompt, prompt_token_ids, params, arrival_time, priority)
                    ("abort", [request_id, ...]), ("stats",), ("reset",), ("problems",), ("stop",)
  core -> frontend: ("ready", config, vocab_size), ("out", [RequestOutput, ...], stats) once per step,
                    ("fail", stage, error type, message, [ended request_id, ...], [RequestOutput, ...], stats)
                    for a StepError, ("refused", request_id, error type, message) for an add the engine refused,
                    ("stats", stats), ("reset", [dropped request_id, ...], stats), ("problems", [str, ...]),
                    ("fatal", message)
The core never outlives the frontend: PR_SET_PDEATHSIG (SIGKILL) and a thread watching its parent end it.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.platform.parent import exit_with_parent

logger = logging.getLogger(__name__)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder()


def core_main(config: EngineConfig, in_addr: str, out_addr: str, parent: int) -> None:
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
        code = EngineCoreLoop(config, inbox, outbox, enc).run()
    except BaseException as exc:  # startup failed or the loop broke: say why, then exit non-zero
        logger.exception("the engine core stopped")
        try:
            outbox.send(enc.encode(("fatal", f"{type(exc).__name__}: {exc}")))
        except Exception:
            pass
        code = 1
    outbox.close(linger=2000)
    inbox.close(linger=0)
    os._exit(code)


class EngineCoreLoop:
    """The busy loop: while requests are in the engine, apply what arrived and step; idle, wait for a message."""

    def __init__(self, config: EngineConfig, inbox, outbox, enc) -> None:
        from engine.llm_engine import LLMEngine

        self.engine = LLMEngine(config)
        self.inbox, self.outbox, self.enc = inbox, outbox, enc
        self.dec = decoder()
        vocab = min(len(self.engine.tokenizer), int(self.engine.hf_config.vocab_size))
        self._send(("ready", msgspec.to_builtins(self.engine.config), vocab))

    def _send(self, msg: tuple) -> None:
        self.outbox.send(self.enc.encode(msg), copy=False)

    def run(self) -> int:
        from engine.faults import StepError
        from engine.worker.tp_workers import TensorParallelError

        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            # Idle: wait for the next message; busy: take what has arrived and step.
            while self.inbox.poll(0 if busy else None):
                if not self._handle(self.dec.decode(self.inbox.recv(copy=False))):
                    engine.shutdown(graceful=True)
                    return 0
                busy = engine.has_unfinished_requests()
            if not busy:
                continue
            try:
                outputs = engine.step()
            except StepError as exc:
                self._send(("fail", exc.stage, type(exc.cause).__name__, str(exc.cause), exc.request_ids,
                            exc.outputs, engine.get_stats()))
                continue
            except TensorParallelError as exc:
                self._send(("fatal", str(exc)))
                engine.shutdown(graceful=False)
                return 1
            self._send(("out", outputs, engine.get_stats()))

    def _handle(self, msg: list) -> bool:
        """Apply one message; False for "stop"."""
        from engine.sampling_params import SamplingParams

        kind = msg[0]
        engine = self.engine
        if kind == "add":
            _, request_id, prompt, token_ids, params, arrival, priority = msg
            try:
                engine.add_request(request_id, prompt, token_ids, msgspec.convert(params, SamplingParams),
                                   arrival, priority)
            except Exception as exc:  # this request alone (the frontend checked its input already)
                engine.abort_request(request_id)  # whatever of it got into a queue
                self._send(("refused", request_id, type(exc).__name__, str(exc)))
        elif kind == "abort":
            engine.abort_request(msg[1])
            self._send(("stats", engine.get_stats()))  # the freed blocks show in /metrics without a step
        elif kind == "reset":
            self._send(("reset", engine.reset(), engine.get_stats()))
        elif kind == "stats":
            self._send(("stats", engine.get_stats()))
        elif kind == "problems":
            self._send(("problems", engine.block_problems()))
        elif kind == "stop":
            return False
        return True


def spawn(config: EngineConfig, in_addr: str, out_addr: str) -> Any:
    """Start the core process (multiprocessing spawn: a fresh interpreter, no inherited threads or locks)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=core_main, args=(config, in_addr, out_addr, os.getpid()), name="engine-core",
                       daemon=False)
    proc.start()
    return proc


if __name__ == "__main__":  # pragma: no cover
    sys.exit("engine/core_proc.py runs as the server's spawned engine core (pagedserve serve --engine-process)")
