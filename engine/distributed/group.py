"""Tensor parallelism's process group: which rank this process is, and the collectives the model and the engine
run. torch.distributed does the transport: gloo on CPU, NCCL on CUDA.

Two ways to start the ranks (docs/deployment.md, "Tensor parallelism"):
- spawned: the driver (rank 0, the process that serves HTTP) starts ranks 1..N-1 on this host
  (engine/worker/tp_workers.py); they meet at a loopback port the driver picked;
- torchrun, on one host or several: every process finds RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (and
  LOCAL_RANK) in its environment; rank 0 serves, the others run the worker loop.

Use (the model and the engine, on every rank, in the same order):

    tp = TPGroup.single()                       # one rank: every collective is the identity
    x = tp.all_reduce(x)                        # [num_tokens, hidden]: the sum of every rank's partial x
    logits = tp.gather_cols(local_logits)       # [rows, vocab] on rank 0 from [rows, vocab / N] each; None elsewhere
    msg = tp.broadcast(msg if tp.is_driver else None)
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The step broadcast waits as long as the server idles between requests: its group never times out on its own.
# A driver that dies closes the sockets, which ends the wait at once (worker loop, engine/worker/tp_workers.py).
_IDLE_WAIT = datetime.timedelta(days=365)


class StartupError(RuntimeError):
    """The ranks could not form their group (port in use, a rank that never joined); the message says which."""


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group; without a group (one rank, not launched by torchrun)
    every collective is the identity. A torchrun launch of one rank runs them through the backend."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # the process group of the model's collectives (gloo or NCCL); None at world_size 1
    step_group: Any = None  # gloo, for the step broadcast: never times out while the server idles

    @classmethod
    def single(cls) -> "TPGroup":
        return cls()

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly (the caller checked that N divides n)."""
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (row-parallel outputs, the vocab-parallel embedding)."""
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_cols(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """[rows, n / N] on each rank -> [rows, n] on rank 0 (ranks' columns in rank order); None on the others."""
        if self.group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.is_driver else None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's picklable obj on every rank (one broadcast per step: the step's whole input)."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.step_group)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest value over the ranks (the KV cache blocks every rank can hold)."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.step_group)
        return int(t.item())

    def destroy(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.group = self.step_group = None


def torchrun_env() -> Optional[tuple[int, int]]:
    """(rank, world_size) when this process was started by torchrun (or its variables set by hand), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_tp_group(rank: int, world_size: int, device: torch.device, addr: str, port: int,
                  timeout_s: float, from_env: bool = False) -> TPGroup:
    """Join the group as `rank`: rank 0 listens on addr:port, the others connect there; every rank waits at
    most timeout_s for the rest (StartupError then, naming the address). Also each collective's time limit.

    from_env: a torchrun launch; its agent may already hold the store at MASTER_ADDR:MASTER_PORT, which
    torch's env:// rendezvous then joins (TORCHELASTIC_USE_AGENT_STORE) instead of listening there again."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if dist.is_initialized():  # torch allows one default group per process: one tensor-parallel engine
        raise StartupError("tensor parallelism: this process already holds a tensor-parallel group (another "
                           "engine with --tensor-parallel-size > 1); shut that one down first.")
    try:
        init_method = "env://" if from_env else f"tcp://{addr}:{port}"
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank, timeout=timeout)
        # A second group, gloo on either device, for the step broadcast (a CPU object) and its idle waits.
        step_group = dist.new_group(backend="gloo", timeout=_IDLE_WAIT)
    except Exception as exc:  # torch raises RuntimeError / DistStoreError / DistNetworkError with long texts
        if dist.is_initialized():
            dist.destroy_process_group()
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        role = f"rank {rank} of {world_size}"
        raise StartupError(f"tensor parallelism: {role} could not form the group at {addr}:{port} within "
                           f"{timeout_s:g} s ({type(exc).__name__}: {reason}). Is the port free, and did every "
                           "rank start (--distributed-timeout)?") from exc
    logger.info("tensor-parallel rank %d of %d joined (%s, %s:%d)", rank, world_size, backend, addr, port)
    return TPGroup(rank, world_size, dist.group.WORLD, step_group)


def cpu_threads_per_rank(world_size: int) -> int:
    """On CPU each rank gets its share of the cores this process may run on (at least one)."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)
