"""Helpers of the reliability suite: real uvicorn servers around the real engine and a tiny random Llama.

The HTTP helpers (ServerThread, sse_events, metric) come from tests/server/serving_harness.py, reused as is.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Iterator, Optional

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))  # serving_harness: run alone, tests/server is not on the path
sys.path.insert(0, str(ROOT / "scripts"))  # soak.py starts CLI servers for the soak and for these tests
os.environ["HF_HUB_OFFLINE"] = "1"

import core_faults  # noqa: E402
from engine.core_proc import FAULT_INJECTOR_ENV  # noqa: E402
from engine.frontend.core_client import RemoteEngineCore  # noqa: E402
from serving_harness import ServerThread, metric, sse_events  # noqa: E402
from soak import start_server  # noqa: E402

# Figures of the last run, for docs/reliability.md (outside the repo: nothing to commit by accident).
REPORT = pathlib.Path(os.environ.get("PAGEDSERVE_RELIABILITY_REPORT", "/tmp/pagedserve-reliability.json"))


def record(section: str, figures: dict[str, Any]) -> None:
    """Merge one test's figures into the report file and print them (pytest -s shows them)."""
    data = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    data[section] = figures
    REPORT.write_text(json.dumps(data, indent=2, sort_keys=True))
    print(f"\n[{section}] {figures}")


@contextlib.contextmanager
def serve(model_dir: pathlib.Path, core_process: bool = False, faults: bool = False,
          **config: Any) -> Iterator[ServerThread]:
    """A real uvicorn server (in this process, a thread) around AsyncLLMEngine(LLMEngine(config)).

    In-process so a test can read the block manager itself; `server.engine` is the AsyncLLMEngine.
    core_process: the engine core in a process of its own instead (RemoteEngineCore, as `serve
    --engine-core-process`); leaked_blocks() then asks the core. faults: the engine's fault_injector is
    core_faults.by_request_id (requests ask for a fault by their request_id), set through the core's test hook in
    the core process; `server.fault_log` is the file each fault fired is written to (core_faults.fired reads it).
    """
    from engine.frontend.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from server.app import create_app

    fields = dict(model=str(model_dir), max_model_len=128, block_size=16, num_gpu_blocks_override=256,
                  num_cpu_blocks_override=64, seed=0)
    fields.update(config)
    with tempfile.TemporaryDirectory(prefix="pagedserve-faults-") as folder, contextlib.ExitStack() as stack:
        fault_log = pathlib.Path(folder) / "fired"
        if faults:  # (the core process copies this environment when it starts)
            stack.enter_context(_environ({core_faults.LOG_ENV: str(fault_log),
                                          **({FAULT_INJECTOR_ENV: core_faults.HOOK} if core_process else {})}))
        if core_process:
            engine = AsyncLLMEngine(RemoteEngineCore.start(EngineConfig(**fields)), log_stats=False)
        else:
            engine = AsyncLLMEngine.from_config(EngineConfig(**fields), log_stats=False)
            if faults:
                engine.engine.fault_injector = core_faults.by_request_id(engine.engine)
        with ServerThread(create_app(engine, served_model_name="tiny")) as server:
            server.engine, server.fault_log = engine, fault_log
            yield server


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def wait_engine_idle(server: ServerThread, timeout_s: float = 30.0) -> None:
    """Until the engine holds no request and no stream: aborts travel through the loop's queue."""
    eng = server.engine
    deadline = time.monotonic() + timeout_s
    while eng.engine.has_unfinished_requests() or eng._streams or (eng._queue is not None and not eng._queue.empty()):
        assert time.monotonic() < deadline, f"engine not idle after {timeout_s} s: {eng!r}"
        time.sleep(0.05)
    time.sleep(0.2)  # the loop refreshes the gauges when it goes idle


def leaked_blocks(server: ServerThread) -> dict[str, int]:
    """Device and swap blocks not in the pool, and block tables still held, read off the block manager.

    Of an engine core in its own process: the blocks from its figures, and for "block_tables" the number of broken
    block invariants it reports (faults.block_problems: in an idle engine every table left is one), asked in the
    step thread, the one thread that talks to the core."""
    core = server.engine.engine
    if isinstance(core, RemoteEngineCore):
        stats, problems = server.engine._executor.submit(lambda: (core.get_stats(), core.block_problems())).result(60)
        return {"device_blocks": round(stats.device_cache_usage * stats.num_device_blocks),
                "cpu_blocks": round(stats.cpu_cache_usage * stats.num_cpu_blocks), "block_tables": len(problems)}
    bm = core.scheduler.block_manager
    return {
        "device_blocks": bm.num_device_blocks - bm.get_num_free_device_blocks(),
        "cpu_blocks": bm.num_cpu_blocks - bm.get_num_free_cpu_blocks(),
        "block_tables": len(bm.block_tables) + len(bm.cpu_block_tables),
    }


def gauges(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    names = ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
             "cpu_cache_usage_perc")
    return {k: metric(text, f"pagedserve:{k}") for k in names}


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> dict[str, Any]:
    """POST a stream=true body; the joined text per choice, finish reasons, usage, and any error event."""
    texts: dict[int, str] = {}
    reasons: dict[int, Optional[str]] = {}
    result: dict[str, Any] = {"status": None, "error": None, "usage": None, "done": False, "chunks": 0}
    async with client.stream("POST", url, json={**body, "stream": True,
                                                "stream_options": {"include_usage": True}}) as r:
        result["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            result["error"] = r.json().get("error")
            return result
        lines = [line async for line in r.aiter_lines()]
    for event in sse_events(lines):
        if event == "[DONE]":
            result["done"] = True
        elif "error" in event:
            result["error"] = event["error"]
        elif event.get("usage"):
            result["usage"] = event["usage"]
        for c in event.get("choices", []) if isinstance(event, dict) else []:
            result["chunks"] += 1
            texts[c["index"]] = texts.get(c["index"], "") + c.get("text", "")
            if c.get("finish_reason"):
                reasons[c["index"]] = c["finish_reason"]
    result["texts"] = [texts[i] for i in sorted(texts)]
    result["finish_reasons"] = [reasons.get(i) for i in sorted(texts)]
    return result


def start_cli_server(args: list[str], log_path: pathlib.Path, timeout_s: float = 180.0):
    """`pagedserve serve ...` in its own process, one thread per OpenMP team; (proc, base_url)."""
    return start_server(args, str(log_path), timeout_s, env={"OMP_NUM_THREADS": "1"})
