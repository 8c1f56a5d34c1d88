"""POST /v1/responses through the real server and the default SmolLM2, driven by the openai client's Responses API."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from bad_inputs import MODEL
from serving_harness import wait_idle

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_text(client, messages, max_tokens=12) -> str:
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content


def stored(server) -> int:
    """How many responses the server keeps (its ServerContext's store)."""
    return len(server.server.config.app.state.ctx.responses)


def prompt_len(real_server, messages) -> int:
    return httpx.post(real_server.base_url + "/tokenize", json={"messages": messages}).json()["count"]


def test_text_input_with_instructions_is_the_chat_answer(client, real_server):
    r = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer in one sentence.",
                                max_output_tokens=12, temperature=0)
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}]
    assert r.object == "response" and r.id.startswith("resp_") and r.instructions == "Answer in one sentence."
    assert r.output_text == chat_text(client, messages) and "Paris" in r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == prompt_len(real_server, messages) and 1 <= r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_message_list_input_and_max_output_tokens(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a long story."}]
    r = client.responses.create(model=MODEL, input=messages, max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output_text == chat_text(client, messages, max_tokens=5)
    parts = client.responses.create(model=MODEL, temperature=0, max_output_tokens=5, input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}])
    assert parts.output_text == r.output_text  # developer is the system role; content parts join to the same text


def test_top_p_and_temperature_reach_the_sampler(client):
    greedy = client.responses.create(model=MODEL, input="Write a word:", max_output_tokens=8, temperature=0)
    narrow = client.responses.create(model=MODEL, input="Write a word:", max_output_tokens=8, temperature=1.5,
                                     top_p=1e-6)
    assert narrow.output_text == greedy.output_text and narrow.top_p == 1e-6 and narrow.temperature == 1.5
    hot = {client.responses.create(model=MODEL, input="Write a word:", max_output_tokens=8, temperature=2.0).output_text
           for _ in range(3)}
    assert hot != {greedy.output_text}


def test_streaming_events_assemble_the_response(client):
    want = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0,
                                          stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == events[-1].response.output_text == want.output_text
    assert events[-1].response.usage.output_tokens == want.usage.output_tokens


def test_stream_helper_final_response(client):
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) and final.status == "incomplete"
    assert final.usage.output_tokens == 4


def test_store_false_keeps_nothing(client, real_server):
    kept = stored(real_server)
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert r.store is False and stored(real_server) == kept
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="And?", previous_response_id=r.id, max_output_tokens=3)


def test_store_true_retrieve_continue_delete(client, real_server):
    first = client.responses.create(model=MODEL, input="My name is Bob.", max_output_tokens=8, temperature=0,
                                    store=True)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.store is True
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0)
    conversation = [{"role": "user", "content": "My name is Bob."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_len(real_server, conversation)
    assert second.output_text == chat_text(client, conversation, max_tokens=10)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def _abort_when_running(engine, prefix: str = "", timeout_s: float = 30.0) -> str:
    """Abort, from outside its reader, the engine request whose id starts with prefix once the engine holds it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ids = [rid for rid in engine.engine.request_ids() if rid.startswith(prefix)]
        except RuntimeError:  # a queue changed under the read (the step thread runs): read again
            continue
        if ids:
            engine.abort(ids[0])
            return ids[0]
        time.sleep(0.01)
    raise AssertionError("the request never reached the engine")


def test_a_stream_the_engine_ends_early_fails_instead_of_completing(client, real_server):
    # A request the engine ends without a finished output (an abort from outside its reader) is a failed
    # response: OpenAI's response.failed with status "failed" and an error, not response.completed.
    events = []
    for event in client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=400,
                                         temperature=0, stream=True):
        events.append(event)
        if event.type == "response.output_text.delta" and len(events) == 5:
            _abort_when_running(real_server.engine, events[0].response.id)
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed", [e.type for e in events[-3:]]
    error = last.response.error
    assert error.code == "server_error" and "before its output was finished" in error.message
    assert last.response.output[0].status == "incomplete"
    assert last.response.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_response_the_engine_ends_early_is_a_500(real_server):
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 400, "temperature": 0}
    wait_idle(real_server.base_url, timeout_s=10)  # an earlier test's abort may still be on its way to the engine
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, real_server.base_url + "/v1/responses", json=body, timeout=120)
        _abort_when_running(real_server.engine)
        r = reply.result()
    assert r.status_code == 500 and "before its output was finished" in r.json()["error"]["message"]


def test_output_text_logprobs_equal_chat_logprobs(client):
    messages = [{"role": "user", "content": QUESTION}]
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=3,
                                include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=3)
    logprobs = r.output[0].content[0].logprobs
    assert r.top_logprobs == 3 and len(logprobs) == r.usage.output_tokens == 6
    assert "".join(t.token for t in logprobs) == r.output_text
    want = chat.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in logprobs] == [(t.token, t.logprob, t.bytes) for t in want]
    assert [[(a.token, a.logprob) for a in t.top_logprobs] for t in logprobs] == [
        [(a.token, a.logprob) for a in t.top_logprobs] for t in want]
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in logprobs)  # greedy

    # Streamed: the delta events carry the same tokens and logprobs, and so does the done event.
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0,
                                          top_logprobs=3, include=["message.output_text.logprobs"], stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    for got in (streamed, done.logprobs):
        assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in got] == [
            (t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in logprobs]
    assert events[-1].response.output[0].content[0].logprobs == logprobs

    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=3)
    assert plain.output[0].content[0].logprobs is None  # (not included: as vLLM, top_logprobs alone adds none)


def test_enable_response_messages_shows_what_the_model_read_and_wrote(client, real_server):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5, temperature=0,
                                extra_body={"enable_response_messages": True})
    tokenized = httpx.post(real_server.base_url + "/tokenize",
                           json={"messages": [{"role": "user", "content": QUESTION}]}).json()["tokens"]
    (prompt,), (output,) = r.input_messages, r.output_messages
    assert prompt["type"] == output["type"] == "raw_message_tokens"
    assert prompt["tokens"] == tokenized and QUESTION in prompt["message"]
    assert prompt["message"].startswith("<|im_start|>")  # the chat template's text, as the model read it
    assert output["message"] == r.output_text and len(output["tokens"]) == r.usage.output_tokens == 5
    assert httpx.post(real_server.base_url + "/detokenize", json={"tokens": output["tokens"]}).json()["prompt"] \
        == r.output_text
    assert client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2).input_messages is None


def _poll(client, response_id: str, until, timeout_s: float = 60.0) -> tuple[object, list[str]]:
    """GET the response until until(status) holds; returns it and the statuses seen."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = client.responses.retrieve(response_id)
        if not seen or seen[-1] != got.status:
            seen.append(got.status)
        if until(got.status):
            return got, seen
        time.sleep(0.02)
    raise AssertionError(f"response {response_id} still {seen[-1]!r} after {timeout_s} s ({seen})")


def test_background_response_is_polled_to_completion(client, real_server):
    want = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=40, temperature=0)
    r = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=40, temperature=0,
                                background=True)
    assert r.status == "queued" and r.background is True and r.store is True and r.output == [] and r.usage is None
    got, seen = _poll(client, r.id, lambda status: status not in ("queued", "in_progress"))
    assert seen[-1] == want.status and set(seen) <= {"queued", "in_progress", want.status}, seen
    assert "in_progress" in seen  # (40 tokens take far longer than a poll)
    assert got.output_text == want.output_text and got.usage.output_tokens == want.usage.output_tokens
    assert got.background is True and got.id == r.id
    second = client.responses.create(model=MODEL, input="Go on.", previous_response_id=r.id, max_output_tokens=3)
    assert second.previous_response_id == r.id  # a finished background response is a conversation to continue
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        client.responses.cancel(r.id)  # it is over
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model=MODEL, input="Hi", background=True, store=False)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.responses.create(model=MODEL, input="Hi", background=True, stream=True)


def test_cancel_ends_a_background_response_and_frees_its_blocks(client, real_server):
    wait_idle(real_server.base_url, timeout_s=10)
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=400, temperature=0,
                                background=True)
    _poll(client, r.id, lambda status: status == "in_progress")
    with pytest.raises(openai.BadRequestError, match="only a finished response"):
        client.responses.create(model=MODEL, input="And?", previous_response_id=r.id, max_output_tokens=3)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.id == r.id
    assert client.responses.retrieve(r.id).status == "cancelled"
    waited, values = wait_idle(real_server.base_url, timeout_s=10)  # the abort reached the engine: blocks freed
    assert values["kv_cache_usage_perc"] == 0.0 and values["num_requests_running"] == 0, values
    time.sleep(0.2)
    assert client.responses.retrieve(r.id).status == "cancelled"  # the ended task wrote nothing over it
    with pytest.raises(openai.BadRequestError, match="is cancelled"):
        client.responses.cancel(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_deleting_a_running_background_response_ends_it(client, real_server):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=400, temperature=0,
                                background=True)
    _poll(client, r.id, lambda status: status == "in_progress")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    waited, values = wait_idle(real_server.base_url, timeout_s=10)
    assert values["kv_cache_usage_perc"] == 0.0 and values["num_requests_running"] == 0, values
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)  # (its task ended without storing it again)


def test_a_background_response_the_engine_ends_early_fails(client, real_server):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=400, temperature=0,
                                background=True)
    _abort_when_running(real_server.engine, r.id)
    got, _ = _poll(client, r.id, lambda status: status not in ("queued", "in_progress"))
    assert got.status == "failed" and got.error.code == "server_error"
    assert "before its output was finished" in got.error.message


def test_background_responses_past_the_bound_are_a_503(client, real_server):
    """Nothing ties a background response to a connection: past ctx.max_background running at once the next is
    refused (503, retryable), and once they end another is taken."""
    ctx = real_server.server.config.app.state.ctx
    bound, ctx.max_background = ctx.max_background, 1
    try:
        r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=400,
                                    temperature=0, background=True)
        with pytest.raises(openai.InternalServerError, match="background responses are in progress") as err:
            client.with_options(max_retries=0).responses.create(model=MODEL, input="Hi", background=True)
        assert err.value.status_code == 503
        client.responses.cancel(r.id)
        _poll(client, r.id, lambda status: status == "cancelled")
        deadline = time.monotonic() + 30
        while ctx.background and time.monotonic() < deadline:  # the task unwinds after the cancel returns
            time.sleep(0.02)
        later = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, background=True)
        _poll(client, later.id, lambda status: status not in ("queued", "in_progress"))
    finally:
        ctx.max_background = bound
