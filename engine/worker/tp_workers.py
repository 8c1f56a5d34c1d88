"""Tensor parallelism's other ranks: the driver's handle on them (TPWorkers) and the loop each one runs.

The driver (rank 0) keeps the scheduler, block manager, tokenizer and HTTP server. Each step it broadcasts one
StepMessage: the scheduler's cache moves (swap out, swap in, copy) and the forward's input (token ids,
positions, slot mapping, block tables). Every rank applies the moves to its own KV cache (its share of the
key/value heads) and runs the forward on its shard; the all-reduces inside keep them in step and rank 0
gets the gathered logits, samples, and does the rest alone.

Use (engine/llm_engine.py):

    workers, tp = TPWorkers.start(config, device)   # spawns ranks 1..N-1, or joins a torchrun launch
    runner.workers = workers                        # ModelRunner.execute sends each step through it
    workers.shutdown()                              # every rank's loop returns; spawned processes are joined

Faults: a rank that dies is seen at once for spawned ranks (a watcher thread on their process sentinels calls
on_death), and by the next collective for torchrun ranks (its sockets close). The engine cannot go on
without it: it stops, its requests fail, /health answers 503 and the server exits with status 1 for its
supervisor to restart it (docs/deployment.md). A rank whose driver dies exits at once too.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Callable, Optional

import torch

from engine.config import EngineConfig
from engine.platform.parent import exit_with_parent
from engine.distributed.group import (StartupError, TPGroup, cpu_threads_per_rank, free_port, init_tp_group,
                                torchrun_env)
from engine.worker.model_runner import ModelInput

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 10.0  # spawned ranks get this long to leave after the stop message, then are killed


class TensorParallelError(RuntimeError):
    """The ranks are out of step (one died, or a forward failed on the way): the engine cannot go on."""


@dataclass
class StepMessage:
    """Everything the other ranks need for one step, sent in one broadcast."""

    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)  # device block -> host block
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)  # host block -> device block
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    inp: Optional[ModelInput] = None  # the forward's input (CPU tensors); None: cache moves only
    stop: bool = False  # the workers' loops return


# How long a broken collective waits for a spawned rank's exit to show (TPWorkers.fatal).
FATAL_EXIT_WAIT_S = 2.0


class TPWorkers:
    """The driver's side of ranks 1..N-1: step broadcasts, health, shutdown."""

    def __init__(self, tp: TPGroup, processes: list, num_threads: Optional[int] = None) -> None:
        self.tp = tp
        self.processes = processes  # spawned ranks (multiprocessing.Process); empty under torchrun
        self._num_threads = num_threads  # torch's thread count before start(); shutdown restores it
        self.dead_reason: Optional[str] = None
        self.on_death: Optional[Callable[[TensorParallelError], None]] = None
        self._stopping = False
        if processes:
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> tuple["TPWorkers", TPGroup]:
        """Start (or, under torchrun, meet) the other ranks and join the group as rank 0."""
        world = config.tensor_parallel_size
        env = torchrun_env()
        if env is not None and (env[0] != 0 or env[1] != world):
            raise StartupError(f"--tensor-parallel-size {world} does not match this torchrun launch (RANK "
                               f"{env[0]}, WORLD_SIZE {env[1]}): rank 0 serves, the others run the worker.")
        # On CPU this rank computes on its share of the cores while the ranks run (torch's thread count is
        # process-wide: shutdown gives the process its own count back).
        num_threads = torch.get_num_threads() if device.type == "cpu" else None
        if num_threads is not None:
            torch.set_num_threads(cpu_threads_per_rank(world))
        processes = []
        try:
            if env is not None:
                addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
            else:
                addr, port = "127.0.0.1", free_port()
                ctx = multiprocessing.get_context("spawn")  # fork would copy a process that already runs threads
                for rank in range(1, world):
                    p = ctx.Process(target=_spawned_main, args=(config, rank, world, addr, port),
                                    name=f"pagedserve-tp{rank}", daemon=True)
                    p.start()
                    processes.append(p)
            tp = init_tp_group(0, world, device, addr, port, config.distributed_timeout, from_env=env is not None)
        except BaseException:
            _end(processes, timeout_s=0.0)
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            raise
        return cls(tp, processes, num_threads), tp

    def send_step(self, out, inp: Optional[ModelInput]) -> None:
        """Broadcast one step (the scheduler's cache moves and the forward's input, if any)."""
        self.check()
        msg = StepMessage(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy, inp)
        try:
            self.tp.broadcast(msg)
        except Exception as exc:
            raise self.fatal(exc) from exc

    def check(self) -> None:
        if self.dead_reason is not None:
            raise TensorParallelError(self.dead_reason)

    def fatal(self, exc: BaseException) -> TensorParallelError:
        """The error that ends the engine after `exc` broke a step the ranks had begun together.

        A rank that died breaks the collective it was part of (its sockets close) before the watcher thread may
        have seen its exit: the exit is waited for a moment, so that the error names the rank."""
        if self.dead_reason is None and self.processes:
            dead = self._first_exit(timeout_s=FATAL_EXIT_WAIT_S)
            if dead is not None:
                self.dead_reason = self._exit_reason(dead)
        reason = self.dead_reason or (f"a tensor-parallel step failed after the ranks began it "
                                      f"({type(exc).__name__}: {exc}); the ranks are out of step")
        self.dead_reason = reason
        return TensorParallelError(reason)

    def _first_exit(self, timeout_s: Optional[float]):
        """The first spawned rank to exit (None: none did within timeout_s)."""
        sentinels = {p.sentinel: p for p in self.processes}
        ready = wait(list(sentinels), timeout=timeout_s)
        if not ready:
            return None
        p = sentinels[ready[0]]
        p.join(0.1)
        return p

    def _exit_reason(self, p) -> str:
        return (f"tensor-parallel rank {self.processes.index(p) + 1} (pid {p.pid}) exited with code {p.exitcode}; "
                f"the engine cannot run without it")

    def _watch(self) -> None:
        p = self._first_exit(timeout_s=None)
        if self._stopping:
            return
        self.dead_reason = self._exit_reason(p)
        logger.error("%s", self.dead_reason)
        if self.on_death is not None:
            self.on_death(TensorParallelError(self.dead_reason))

    def shutdown(self, graceful: bool = True) -> None:
        """End every rank's loop (graceful: a stop message, when no step is running) and join the spawned ones."""
        if self._stopping:
            return
        self._stopping = True
        if graceful and self.dead_reason is None:
            try:
                self.tp.broadcast(StepMessage(stop=True))
            except Exception as exc:  # a rank already gone: nothing to tell it
                logger.warning("tensor-parallel stop message failed: %s", exc)
        _end(self.processes)
        self.tp.destroy()
        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)


def _end(processes: list, timeout_s: float = _JOIN_TIMEOUT_S) -> None:
    for p in processes:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()


def run_worker(config: EngineConfig, rank: int, world: int, addr: str, port: int, from_env: bool = False) -> int:
    """The loop of ranks 1..N-1: build this rank's shard and cache, then run each step the driver broadcasts
    until the stop message (0) or until the driver is gone (1). from_env: a torchrun launch."""
    from engine import ops
    from engine.model_executor.loader import resolve_device
    from engine.worker.rank_state import RankState

    config = dataclasses.replace(config)  # resolved below and in RankState.build: this rank's own copy
    device = resolve_device(config)
    config.resolve_block_size(device.type)  # as LLMEngine does on rank 0
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world))
    ops.require_backend(device)
    tp = init_tp_group(rank, world, device, addr, port, config.distributed_timeout, from_env)
    try:
        state = RankState.build(config, tp)
        cache, runner = state.cache_engine, state.runner
        while True:
            try:
                msg: StepMessage = tp.broadcast(None)
            except Exception as exc:  # the driver's sockets closed: it died or shut down without a word
                logger.error("tensor-parallel rank %d: the driver is gone (%s); exiting", rank, exc)
                return 1
            if msg.stop:
                logger.info("tensor-parallel rank %d: stopped by the driver", rank)
                return 0
            cache.swap(msg.blocks_to_swap_out, msg.blocks_to_swap_in)
            cache.copy(msg.blocks_to_copy)
            if msg.inp is not None:
                runner.forward(msg.inp, cache.device_cache)
    finally:
        tp.destroy()


def _spawned_main(config: EngineConfig, rank: int, world: int, addr: str, port: int) -> None:
    """Entry point of a rank the driver spawned."""
    # Ctrl-C reaches the whole process group: only the driver decides (it drains, then stops the ranks).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s tp{rank} %(name)s: %(message)s")
    exit_with_parent(os.getppid(), "tp-parent-watch", poll_s=1.0)  # never outlive the driver, even SIGKILLed
    try:
        code = run_worker(config, rank, world, addr, port)
    except StartupError as exc:
        logger.error("%s", exc)
        code = 2
    os._exit(code)  # no interpreter teardown: nothing left to flush, and gloo's threads need no join
