"""Bodies over the size limit, and prompts or n values that could exhaust the KV cache: a 4xx before the engine."""
from __future__ import annotations

import httpx
import pytest

from reliability_harness import serve
from server.app import MAX_BODY_BYTES

GPU_BLOCKS = 36  # 16-token blocks: 576 token slots
MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with serve(tiny_llama_dir, max_model_len=128, num_gpu_blocks_override=GPU_BLOCKS, max_num_seqs=MAX_NUM_SEQS) as s:
        added: list[str] = []
        engine = s.engine.engine
        real_add = engine.add_request

        def spy(request_id, *args, **kwargs):  # what reached the engine
            added.append(request_id)
            return real_add(request_id, *args, **kwargs)

        engine.add_request = spy
        s.added = added
        yield s


@pytest.fixture(autouse=True)
def _fresh_spy(server):
    server.added.clear()


def _refused(server, response: httpx.Response, status: int, param=None) -> None:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert err["code"] == status and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    assert not server.added, f"{server.added} reached the engine"


def _post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": "tiny", **body}, timeout=60)


def test_body_over_the_limit_with_content_length(server):
    body = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}'
    r = httpx.post(server.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    _refused(server, r, 413)


def test_body_over_the_limit_chunked(server):
    """No Content-Length: the limit must still hold while the body streams in."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536  # 2.5 MiB in all
        yield b'"}'

    r = httpx.post(server.base_url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    _refused(server, r, 413)


@pytest.mark.parametrize("field,value", [("n", 10**6), ("best_of", 10**6), ("n", 129)])
def test_huge_n_refused(server, field, value):
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0.8, field: value}
    if field == "best_of":
        body["n"] = 1
    _refused(server, _post(server, body), 400, field)


def test_n_above_max_num_seqs_refused(server):
    # The batch never holds more than max_num_seqs sequences: such a group could never run.
    _refused(server, _post(server, {"prompt": "Hi", "max_tokens": 2, "temperature": 0.8, "n": MAX_NUM_SEQS + 1}),
             400, "n")


def test_sequences_that_cannot_fit_the_cache_refused(server):
    # 7 sequences of 120 tokens need 7 * 8 = 56 blocks of the 36: it would fail half-way through.
    body = {"prompt": [1000] * 60, "max_tokens": 60, "temperature": 0.8, "n": 7, "ignore_eos": True}
    _refused(server, _post(server, body), 400)
    chat = {"messages": [{"role": "user", "content": "word " * 40}], "max_tokens": 60, "temperature": 0.8,
            "n": 7, "ignore_eos": True}
    _refused(server, _post(server, chat, "/v1/chat/completions"), 400)


def test_prompt_longer_than_context_refused(server):
    _refused(server, _post(server, {"prompt": [1000] * 500, "max_tokens": 4}), 400)
    _refused(server, _post(server, {"prompt": "word " * 5000, "max_tokens": 4}), 400)


def test_server_still_serves_after_the_refusals(server):
    r = _post(server, {"prompt": [1000, 2000, 3000], "max_tokens": 4, "ignore_eos": True, "n": 2, "temperature": 0.8})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert len(server.added) == 1
