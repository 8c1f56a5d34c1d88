"""benchmarks/serving.py's default client (--client raw): one streamed completion over its own HTTP/1.1 connection
on plain asyncio, every SSE event stamped when its bytes arrive, at a fraction of aiohttp's CPU an event (17-21
against 41-47 us on a 2-vCPU Xeon), because it shares the machine with the server it measures."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit


def _fast_text(data: bytes) -> Optional[bool]:
    """Whether an SSE event's JSON carries a non-empty choice text, read without parsing it; None where only a
    parse can tell: an error, a usage object, a second choice, an unusual layout."""
    if b'"error"' in data:
        return None
    u = data.find(b'"usage"')
    if u >= 0 and not (data.startswith(b":null", u + 7) or data.startswith(b": null", u + 7)):
        return None
    t = data.find(b'"text"')
    if t < 0:
        return False
    if data.find(b'"text"', t + 6) >= 0 or (u >= 0 and data.find(b'"usage"', u + 7) >= 0):
        return None
    if data.startswith(b':"', t + 6):
        return data[t + 8:t + 9] != b'"'  # a string that does not close at once is not empty
    if data.startswith(b': "', t + 6):
        return data[t + 9:t + 10] != b'"'
    return None


class RawStream(asyncio.Protocol):
    """One streamed completion over its own HTTP/1.1 connection: the status line and headers, a body framed by
    chunks, Content-Length or the close, its SSE `data:` lines read as `send` reads them, every event stamped
    when its bytes arrive. `done` resolves when the stream ends, with any failure in `res.error` (res: serving.py's
RequestResult: ttft, itl, e2e, error and prompt_len are written)."""

    def __init__(self, res: Any, start: float, count_logprobs: bool):
        self.res, self.start, self.count_logprobs = res, start, count_logprobs
        self.done = asyncio.get_running_loop().create_future()
        self.transport: Optional[asyncio.Transport] = None
        self.head = b""  # the response head until its blank line
        self.status: Optional[int] = None
        self.chunked, self.left = False, None  # framing: chunked, Content-Length bytes to come, or to the close
        self.raw = b""  # chunked bytes not yet decoded
        self.body = b""  # a non-200's body
        self.line = b""  # an SSE line not yet ended
        self.last: Optional[float] = None
        self.usage_tokens: Optional[int] = None
        self.counted = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if self.done.done():
            return
        if self.status is not None and not self.chunked and self.left is None:
            self._body_end(time.perf_counter())  # a body delimited by the close
        else:
            self._fail(f"connection closed before the response ended{f': {exc}' if exc else ''}")

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.done.done():
            return
        try:
            if self.status is None:
                data = self._read_head(data)
                if self.status is None or self.done.done():
                    return
            if self.chunked:
                self._dechunk(data, now)
            elif self.left is None:
                self._payload(data, now)
            else:
                self.left -= len(data)
                self._payload(data, now)
                if self.left <= 0 and not self.done.done():
                    self._body_end(now)
        except (ValueError, IndexError, AttributeError, TypeError) as exc:  # a malformed response or event
            self._fail(f"{type(exc).__name__}: {exc}")

    def _read_head(self, data: bytes) -> bytes:
        """Take the status line and headers (after any 1xx); the bytes after them are the body's."""
        data = self.head + data
        while True:
            i = data.find(b"\r\n\r\n")
            if i < 0:
                self.head = data
                return b""
            lines, data = data[:i].split(b"\r\n"), data[i + 4:]
            status = int(lines[0].split(None, 2)[1])
            if not 100 <= status < 200:
                break
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        self.status, self.head = status, b""
        self.chunked = b"chunked" in headers.get(b"transfer-encoding", b"")
        if not self.chunked and b"content-length" in headers:
            self.left = int(headers[b"content-length"])
            if self.left == 0:
                self._body_end(time.perf_counter())
        return data

    def _dechunk(self, data: bytes, now: float) -> None:
        """Hand on each whole chunk; a chunk cut short waits in `raw` for the rest."""
        buf, pos = (self.raw + data if self.raw else data), 0
        while True:
            i = buf.find(b"\r\n", pos)
            if i < 0:
                break
            size = int(buf[pos:i].split(b";", 1)[0], 16)  # any chunk extension dropped
            if size == 0:
                self._body_end(now)
                return
            end = i + 2 + size
            if end + 2 > len(buf):
                break
            self._payload(buf[i + 2:end], now)
            if self.done.done():
                return
            pos = end + 2
        self.raw = buf[pos:]

    def _payload(self, data: bytes, now: float) -> None:
        if self.status != 200:
            self.body += data
            return
        if not self.line and data.startswith(b"data:") and data.find(b"\n") == len(data) - 2 and data[-1] == 10:
            self._event(data[5:].strip(), now)  # the usual piece: one whole event, "data: ...\n\n"
            return
        lines = (self.line + data if self.line else data).split(b"\n")
        self.line = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):  # not blank separators, ": ping" comments
                self._event(line[5:].strip(), now)
                if self.done.done():
                    return

    def _event(self, data: bytes, now: float) -> None:
        """What `send` takes from one event; the JSON parsed only where `_fast_text` cannot tell."""
        if data == b"[DONE]":
            self._end(now)
            return
        has_text = None if self.count_logprobs else _fast_text(data)
        if has_text is None:
            chunk = json.loads(data)
            if "error" in chunk:
                self._fail(str(chunk["error"]))
                return
            if chunk.get("usage"):
                self.usage_tokens = chunk["usage"].get("completion_tokens")
                self.res.prompt_len = chunk["usage"].get("prompt_tokens", self.res.prompt_len)
            for choice in chunk.get("choices") or []:
                lp = choice.get("logprobs")
                if lp and lp.get("tokens") is not None:
                    self.counted += len(lp["tokens"])
                if choice.get("text"):
                    has_text = True
        if has_text:
            if self.last is None:
                self.res.ttft = now - self.start
            else:
                self.res.itl.append(now - self.last)
            self.last = now

    def _body_end(self, now: float) -> None:
        if self.status == 200 and self.line.startswith(b"data:"):  # a last line the body's end ended
            self._event(self.line[5:].strip(), now)
        if not self.done.done():
            self._end(now)

    def _end(self, now: float) -> None:
        if self.status == 200:
            self.res.e2e = now - self.start
        else:
            self.res.error = f"HTTP {self.status}: {self.body[:200]!r}"
        self.close()

    def _fail(self, error: str) -> None:
        self.res.error = error[:200]
        self.close()

    def close(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


@dataclass
class RawTarget:
    """Where `send_raw` connects (the host resolved once, not per connection) and the request head it sends."""

    host: str
    port: int
    head: bytes  # up to the Content-Length value

    @classmethod
    async def resolve(cls, base_url: str) -> "RawTarget":
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise SystemExit(f"--client raw speaks plain http, not {url.scheme}: use --client aiohttp")
        port = url.port or 80
        infos = await asyncio.get_running_loop().getaddrinfo(url.hostname, port, type=socket.SOCK_STREAM)
        head = (f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: ").encode()
        return cls(infos[0][4][0], port, head)
