"""`pagedserve serve --tensor-parallel-size 2` as processes: a torchrun-style launch of two ranks over loopback,
a rank killed mid-stream, SIGTERM, and the startup failures (port in use, a rank that never joins). With
--engine-core-process the engine core is rank 0 and spawns rank 1: a rank that dies while the core idles stops the
server at once (tests/server/test_engine_core_process.py runs its SIGTERM and SIGKILL tests with two ranks)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import httpx
import pytest
from serving_harness import free_port, wait_unhealthy

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "tiny-tp"


def _serve_cmd(model_dir, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "server.cli", "serve", str(model_dir), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", "2", "--max-model-len", "256",
            "--kv-cache-space", "0.05", "--swap-space", "0.05", "--shutdown-timeout", "3", *extra]


def _start(cmd: list[str], log: pathlib.Path, env: Optional[dict] = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def _wait_healthy(proc: subprocess.Popen, base: str, log: pathlib.Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.3)


def _descendants(pid: int) -> list[int]:
    """Every live process below pid (children, grandchildren), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    """Every one of pids exits within timeout_s (multiprocessing's resource tracker leaves just after its parent)."""
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {p: pathlib.Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in pids if _alive(p)}
    assert left == {}, "processes outlived the server"


def _spawned(server_pid: int) -> list[int]:
    """The processes below the server that multiprocessing spawned (not its resource tracker)."""
    found = []
    for pid in _descendants(server_pid):
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(pid)
    return found


def _rank_processes(server_pid: int) -> list[int]:
    """The spawned ranks below the server (not the engine core process, which spawns them with
    --engine-core-process: the spawned processes that spawned none themselves)."""
    spawned = _spawned(server_pid)
    return [pid for pid in spawned if not set(_descendants(pid)) & set(spawned)]


def _completion(base: str, **body) -> dict:
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def tp1_reference(tiny_llama_dir):
    """The tiny model's greedy tokens and logprobs on one rank, in this process."""
    from engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    out = llm.generate(prompt_token_ids=[[1, 504, 3458, 282, 4649, 314]], sampling_params=params, use_tqdm=False)
    c = out[0].outputs[0]
    return c.token_ids, [step[t] for step, t in zip(c.logprobs, c.token_ids)]


def test_torchrun_launch_of_two_ranks_serves_the_tokens_of_one(tiny_llama_dir, tp1_reference, tmp_path):
    """Two processes started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): rank 0
    serves HTTP, rank 1 follows its steps; SIGTERM to rank 0 ends both."""
    port, master_port = free_port(), free_port()
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
    cmd = _serve_cmd(tiny_llama_dir, port)
    rank1 = _start(cmd, tmp_path / "rank1.log", {**launch, "RANK": "1", "LOCAL_RANK": "1"})
    rank0 = _start(cmd, tmp_path / "rank0.log", {**launch, "RANK": "0", "LOCAL_RANK": "0"})
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(rank0, base, tmp_path / "rank0.log")
        body = _completion(base, prompt=[1, 504, 3458, 282, 4649, 314], max_tokens=8, temperature=0.0,
                           ignore_eos=True, logprobs=1, return_tokens_as_token_ids=True)
        choice = body["choices"][0]
        tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        ref_tokens, ref_logprobs = tp1_reference
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], ref_logprobs)) < 1e-3
        rank0.send_signal(signal.SIGTERM)
        assert rank0.wait(timeout=30) == 0
        assert rank1.wait(timeout=30) == 0, (tmp_path / "rank1.log").read_text()[-2000:]
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
                p.wait()


def _greedy_tokens(base: str, stream: bool) -> tuple[list[int], list[float]]:
    """The token ids and their logprobs of tp1_reference's request, streamed or not."""
    body = {"model": MODEL, "prompt": [1, 504, 3458, 282, 4649, 314], "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True, "stream": stream}
    if stream:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(line[5:]) for line in r.iter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
        logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    else:
        logprobs = [_completion(base, **body)["choices"][0]["logprobs"]]
    tokens = [int(t.removeprefix("token_id:")) for lp in logprobs for t in lp["tokens"]]
    return tokens, [x for lp in logprobs for x in lp["token_logprobs"]]


@pytest.fixture
def spawned_server(tiny_llama_dir, tmp_path, request):
    """A TP=2 server whose rank 1 it spawned itself (parametrized "core-process": its engine core process spawned
    it); yields (process, base URL, log)."""
    port = free_port()
    log = tmp_path / "server.log"
    extra = ("--engine-core-process",) if getattr(request, "param", "in-process") == "core-process" else ()
    proc = _start(_serve_cmd(tiny_llama_dir, port, *extra), log)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log)
        yield proc, base, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_ends_every_rank(spawned_server, tp1_reference):
    """Two ranks stream the greedy tokens of one (logprobs within 1e-3); SIGTERM ends the server and every rank."""
    proc, base, log = spawned_server
    ranks = _rank_processes(proc.pid)
    assert len(ranks) == 1, "one spawned rank for --tensor-parallel-size 2"
    ref_tokens, ref_logprobs = tp1_reference
    for stream in (False, True):
        tokens, logprobs = _greedy_tokens(base, stream)
        assert tokens == ref_tokens, stream
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-3, stream
    family = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    _assert_gone(family)


def test_a_rank_killed_mid_stream_fails_its_requests_and_stops_the_server(spawned_server):
    proc, base, log = spawned_server
    (rank,) = _rank_processes(proc.pid)
    family = _descendants(proc.pid)
    events: list = []
    first = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        events.append(json.loads(line[5:]))
                        first.set()
        except httpx.HTTPError as exc:  # the stream may also be cut with the connection
            events.append({"transport_error": repr(exc)})
        first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    os.kill(rank, signal.SIGKILL)
    reader.join(60)
    assert not reader.is_alive()
    errors = [e for e in events if "error" in e]
    assert errors, f"the stream ended without an error event: {events[-3:]}"
    assert "tensor-parallel rank 1" in errors[0]["error"]["message"]
    assert not [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason") == "length"]
    # Not ready from then on; the process exits with status 1 for its supervisor to restart it.
    with pytest.raises((httpx.HTTPError, AssertionError)):
        assert httpx.get(base + "/health", timeout=2).status_code == 200
    assert proc.wait(timeout=30) == 1, log.read_text()[-3000:]
    _assert_gone(family)


@pytest.mark.parametrize("spawned_server", ["core-process"], indirect=True)
def test_a_rank_that_dies_while_the_core_idles_stops_the_server_at_once(spawned_server):
    """No request in flight, so no step to fail: the core still sees the rank's exit (it looks between messages),
    /health turns 503 within a second, and the server exits 1 naming the rank, leaving no process behind."""
    proc, base, log = spawned_server
    (rank,) = _rank_processes(proc.pid)
    family = _descendants(proc.pid)
    os.kill(rank, signal.SIGKILL)
    wait_unhealthy(base, since=time.monotonic(), within_s=1.0)  # a rank died
    assert proc.wait(timeout=30) == 1, log.read_text()[-3000:]
    assert "exiting with status 1: the engine stopped" in log.read_text()
    assert f"tensor-parallel rank 1 (pid {rank}) exited" in log.read_text().split("exiting with status 1")[1]
    _assert_gone(family)


def _failed_start(tiny_llama_dir, tmp_path, env: dict, *extra: str) -> tuple[int, str, float]:
    log = tmp_path / "server.log"
    t0 = time.monotonic()
    proc = _start(_serve_cmd(tiny_llama_dir, free_port(), *extra), log,
                  {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", **env})
    try:
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, log.read_text(), time.monotonic() - t0


def test_a_taken_master_port_fails_the_start_with_a_message(tiny_llama_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, log, _ = _failed_start(tiny_llama_dir, tmp_path, {"MASTER_PORT": str(port)},
                                     "--distributed-timeout", "5")
    assert code == 2
    assert f"could not form the group at 127.0.0.1:{port}" in log


def test_a_rank_that_never_joins_fails_the_start_within_the_timeout(tiny_llama_dir, tmp_path):
    code, log, elapsed = _failed_start(tiny_llama_dir, tmp_path, {"MASTER_PORT": str(free_port())},
                                       "--distributed-timeout", "3")
    assert code == 2
    assert "rank 0 of 2 could not form the group" in log and "within 3 s" in log
    assert elapsed < 60
