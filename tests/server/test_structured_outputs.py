"""Structured outputs and tool calling through the real server and the official openai client.

The tiny random Llama writes noise, so only the grammar can make its output valid: every check here fails
when the constraint is not applied. The default model (SmolLM2) shows the same through `.parse`.
"""
from __future__ import annotations

import enum
import json
import re

import httpx
import openai
import pytest
from bad_inputs import MODEL
from pydantic import BaseModel, Field
from serving_harness import wait_idle

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "maxLength": 8}}}}}
USER = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(make_tiny_engine):
    """The tiny Llama with room for the tools' system prompt (max_model_len 1024)."""
    from server.app import create_app
    from serving_harness import ServerThread

    engine = make_tiny_engine(max_model_len=1024)
    with ServerThread(create_app(engine)) as running:
        running.engine = engine
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def idle_kv_usage(server) -> float:
    return wait_idle(server.base_url)[1]["kv_cache_usage_perc"]


def check_person(value: dict) -> None:
    assert set(value) == {"name", "age", "tags"} and isinstance(value["name"], str) and len(value["name"]) <= 10
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"red", "green"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_format(client, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=80,
                                       temperature=temperature, seed=3, n=2 if temperature else 1)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        check_person(json.loads(choice.message.content))


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Pet(BaseModel):
    kind: Color
    legs: int


class Owner(BaseModel):
    name: str
    pets: list[Pet]


def test_parse_with_a_nested_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Owner, max_tokens=120,
                                      temperature=0)
    choice = r.choices[0]
    if choice.finish_reason == "length":  # random weights may nest until the budget ends: cut, and said so
        pytest.skip("cut by max_tokens")
    owner = choice.message.parsed
    assert isinstance(owner, Owner) and all(isinstance(p.kind, Color) for p in owner.pets)


def test_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "json_object"},
                                       max_tokens=60, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_guided_choice_and_regex_on_completions(client, server):
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, n=4, seed=1,
                                  extra_body={"guided_choice": ["yes", "no", "maybe so"]})
    assert [c.finish_reason for c in r.choices] == ["stop"] * 4
    assert {c.text for c in r.choices} <= {"yes", "no", "maybe so"}
    r = client.completions.create(model=MODEL, prompt="Date:", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20, temperature=0,
                                       extra_body={"guided_grammar": 'root ::= "ab" [0-9] [0-9]'})
    assert re.fullmatch(r"ab[0-9]{2}", r.choices[0].message.content)
    assert idle_kv_usage(server) == 0.0


def test_a_regex_the_vocabulary_cannot_spell_is_a_400(client, server):
    # No token of SmolLM2's vocabulary spells the byte 0x04: refused before anything runs ("\x04"), or once the
    # output reaches it ("ab\x04"): a 400 the client can parse, streamed or not, never a 503; nothing leaks.
    for regex in ("\x04", "ab\x04"):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Say:", max_tokens=10, temperature=1.0, seed=3, n=2,
                                      extra_body={"guided_regex": regex})
        assert info.value.status_code == 400 and "no token of this model's vocabulary" in info.value.message
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Say:", "max_tokens": 10, "stream": True,
                            "guided_regex": "ab\x04"}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 400 and "allows no token of this model's vocabulary" in error["message"], error
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "ab"
    assert idle_kv_usage(server) == 0.0


def test_streamed_schema_output_is_the_same_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    stream = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=80,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    plain = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=80,
                                           temperature=0)
    assert text == plain.choices[0].message.content
    check_person(json.loads(text))


def test_max_tokens_cut_is_length(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_tool_choice_required(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[WEATHER, TIME], tool_choice="required", max_tokens=120, temperature=0,
                                       parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        assert set(args) == ({"city", "unit"} if call.function.name == "get_weather" else {"zone"})


class Place(BaseModel):
    city: str = Field(max_length=12)


class Trip(BaseModel):
    start: Place
    end: Place


def test_tool_choice_required_with_nested_models(client):
    """Tools whose parameters name their nested models by `$ref: "#/$defs/..."` (what pydantic writes), two of them
    a model `Place` each of its own shape: the "required" grammar carries every tool's definitions to its root,
    where the references resolve, and whichever tool the model calls, its arguments follow that tool's schema."""
    trip = openai.pydantic_function_tool(Trip, name="plan_trip")
    zip_place = {"type": "object", "properties": {"zip": {"type": "string", "maxLength": 5}}, "required": ["zip"],
                 "additionalProperties": False}
    find = {"type": "function", "function": {"name": "find_place", "parameters": {
        "$defs": {"Place": zip_place}, "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}},
        "required": ["at"], "additionalProperties": False}}}
    assert "Place" in trip["function"]["parameters"]["$defs"]
    for tools in ([trip], [find, trip]):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Plan a trip."}],
                                           tools=tools, tool_choice="required", max_tokens=120, temperature=0,
                                           parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0].function
        if call.name == "plan_trip":
            Trip.model_validate_json(call.arguments)
        else:
            at = json.loads(call.arguments)["at"]
            assert call.name == "find_place" and set(at) == {"zip"} and len(at["zip"]) <= 5


def test_named_tool_choice_and_a_tool_result_round_trip(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["unit"] in ("celsius", "fahrenheit")
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    follow = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=5,
                                            tool_choice="none", temperature=0)
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls
    prompt = httpx.post(client.base_url.join("/tokenize").__str__().replace("/v1", ""),
                        json={"messages": messages}).json()
    assert prompt["count"] > 0


def test_streamed_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert set(json.loads(arguments)) == {"city", "unit"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # the call is not also sent as text


def test_auto_tool_calls_are_parsed_from_hermes_output(client):
    # "auto" reads calls from the text: a guided_grammar makes the tiny model write one, as a trained model would.
    grammar = r'''root ::= "Let me check. <tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"" [a-z]{1,5} "\"}}\n</tool_call>"'''
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, TIME], max_tokens=60,
                temperature=0, extra_body={"guided_grammar": grammar})
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert choice.message.tool_calls[0].function.name == "get_time"
    assert re.fullmatch(r"[a-z]{1,5}", json.loads(choice.message.tool_calls[0].function.arguments)["zone"])
    chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check." and "<tool" not in content
    assert deltas[0].function.name == "get_time" and chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("before, content", [(r"\n Let me  check. \n", "\n Let me  check."), (r" \n\n", None)])
def test_streamed_content_before_a_call_is_the_replys_content(client, before, content):
    # Whitespace around the text before a call, and whitespace alone: the stream's content pieces add up to the
    # finished reply's content (its whitespace before the call dropped), never more or less.
    grammar = ('root ::= "' + before + r'<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"utc\"}}'
               r'\n</tool_call>"')
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, TIME], max_tokens=60,
                temperature=0, extra_body={"guided_grammar": grammar})
    r = client.chat.completions.create(**body)
    assert r.choices[0].message.content == content and r.choices[0].message.tool_calls[0].function.name == "get_time"
    chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
    streamed = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(streamed) == (content or ""), streamed
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_text_is_plain(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0)
    assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].finish_reason in ("stop", "length")


class Genre(str, enum.Enum):
    fiction = "fiction"
    science = "science"
    history = "history"


class Book(BaseModel):
    title: str = Field(max_length=40)  # bounds keep a 135M model from looping inside a string
    year: int
    genre: Genre


class Shelf(BaseModel):
    owner: str = Field(max_length=20)
    books: list[Book] = Field(max_length=3)


def test_parse_on_the_default_model(real_server):
    """SmolLM2 through `.parse` with a nested pydantic model (enum, list): valid, parsed, finished by the grammar."""
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "List two books on a shelf owned by Ada, as JSON."}]
    for temperature in (0.0, 0.7):
        r = client.chat.completions.parse(model=client.models.list().data[0].id, messages=messages,
                                          response_format=Shelf, max_tokens=200, temperature=temperature, seed=7)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        shelf = choice.message.parsed
        assert isinstance(shelf, Shelf) and all(isinstance(b.genre, Genre) for b in shelf.books)
