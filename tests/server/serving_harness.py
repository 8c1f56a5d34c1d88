"""A real uvicorn server on 127.0.0.1 (free port) in a thread, plus small client helpers."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from typing import Any, Optional

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn.Server in a daemon thread; the app's lifespan starts and stops the engine loop."""

    def __init__(self, app: Any, timeout_graceful_shutdown: float = 2.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=timeout_graceful_shutdown, timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def sse_events(lines: list[str]) -> list[Any]:
    """The `data:` payloads of an SSE body (comments and blank lines skipped); [DONE] kept as a string."""
    out = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def stream_events(server: ServerThread, path: str, body: dict) -> list[Any]:
    """The events of a streamed POST (body with "stream": true), checked to end with [DONE], which is left out."""
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = sse_events(r.read().decode().splitlines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def metric(text: str, name: str, labels: Optional[str] = None) -> float:
    """One sample's value from Prometheus text (labels: a substring the label set must contain)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and (labels is None or labels in (m.group(2) or "")):
            return float(m.group(3))
    raise KeyError(name)


def wait_idle(base_url: str, timeout_s: float = 2.0, idle_usage: float = 0.0) -> tuple[float, dict[str, float]]:
    """Poll /metrics until running == waiting == 0 and kv usage == idle; returns (seconds waited, values)."""
    start = time.monotonic()
    values: dict[str, float] = {}
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=5).text
        values = {k: metric(text, f"pagedserve:{k}") for k in
                  ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc")}
        idle = (values["num_requests_running"] == 0 and values["num_requests_waiting"] == 0
                and values["num_requests_swapped"] == 0 and values["kv_cache_usage_perc"] <= idle_usage)
        waited = time.monotonic() - start
        if idle or waited > timeout_s:
            return waited, values
        time.sleep(0.05)


def wait_unhealthy(base_url: str, since: float, within_s: float) -> None:
    """Poll /health until it is no longer 200 (or the server is gone); fail if it still is `within_s` seconds
    after `since` (a time.monotonic())."""
    while True:
        try:
            status: Optional[int] = httpx.get(base_url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            status = None  # already going down
        if status != 200:
            return
        assert time.monotonic() - since < within_s, f"/health still 200 {within_s:g} s after the fault"
        time.sleep(0.02)
