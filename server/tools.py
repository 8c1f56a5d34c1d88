"""Tool calling: tools into the prompt, tool_choice into a grammar, the output back into tool calls.

How a chat with `tools` is served:
- The tools reach the model through the chat template when it renders `tools` (a template that mentions
  them); otherwise through a default system message in the Hermes style, which asks for each call as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the `hermes` parser, vLLM's
  `--tool-call-parser hermes`). Earlier calls and tool results in the conversation are rendered the same way.
- tool_choice "auto" (the default): the model decides; calls are parsed from its output.
- "required": the output is a JSON list of `{"name", "parameters"}` objects, one of the tools each, at least
  one (a grammar enforces it); a named function: the output is that function's arguments (its schema).
- "none": the tools are not shown and nothing is parsed.
A reply with calls has `tool_calls` and finish_reason "tool_calls"; a reply cut by max_tokens keeps
"length" and its text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from engine.sampling_params import GuidedSpec
from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage, ChatTool, DeltaFunctionCall, DeltaToolCall, ToolCall

PARSERS = ("hermes",)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ToolPlan:
    """How a chat's tool calls are produced and read back: mode "auto", "required" or "named"."""

    mode: str
    tools: list[dict[str, Any]]  # the request's tools, as OpenAI dicts
    name: Optional[str] = None  # the named function
    parser: str = "hermes"
    parallel: bool = True  # parallel_tool_calls: false allows one call only


def plan(body: ChatCompletionRequest, parser: str) -> Optional[ToolPlan]:
    """The request's tool plan, None without tools or with tool_choice "none". Inconsistent fields are a 400."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools.", 400, "tool_choice")
        return None
    if choice == "none":
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) != len(names):
        raise APIError("tools: two functions have the same name.", 400, "tools")
    if choice is None or choice == "auto":
        return ToolPlan("auto", tools, parser=parser, parallel=body.parallel_tool_calls)
    if choice == "required":
        return ToolPlan("required", tools, parser=parser, parallel=body.parallel_tool_calls)
    if choice.function.name not in names:
        raise APIError(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                       f"({', '.join(names)}).", 400, "tool_choice")
    return ToolPlan("named", tools, name=choice.function.name, parser=parser)


def guided_spec(tool_plan: ToolPlan, tools: list[ChatTool]) -> Optional[GuidedSpec]:
    """The grammar of a required or named tool choice (vLLM's JSON shapes); None for auto."""
    if tool_plan.mode == "auto":
        return None
    params = {t.function.name: t.function.parameters or {"type": "object"} for t in tools}
    if tool_plan.mode == "named":
        return GuidedSpec.json_schema(params[tool_plan.name])
    params, defs = _hoist_defs(params)
    one_call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, schema in params.items()]
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    if not tool_plan.parallel:
        calls["maxItems"] = 1
    if defs:
        calls["$defs"] = defs
    return GuidedSpec.json_schema(calls)


_DEFS_KEYS = ("$defs", "definitions")  # where a schema keeps the definitions its "#/..." references name


def _hoist_defs(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each tool's parameters less their own definitions, and all the definitions, for the root of the "required"
    schema: a tool's `{"$ref": "#/$defs/X"}` (pydantic's nested models) resolves from the document's root, which
    is no longer the tool's. A name two tools define differently becomes `<tool>.<name>` in the second, whose
    references follow."""
    out: dict[str, Any] = {}
    defs: dict[str, Any] = {}
    for tool, schema in params.items():
        if not isinstance(schema, dict) or not any(isinstance(schema.get(k), dict) for k in _DEFS_KEYS):
            out[tool] = schema
            continue
        schema = dict(schema)
        own = [(key, name, sub) for key in _DEFS_KEYS if isinstance(schema.get(key), dict)
               for name, sub in schema.pop(key).items()]
        renames: dict[str, str] = {}
        names = []
        for key, name, sub in own:
            new = name if defs.get(name, sub) == sub else f"{tool}.{name}"
            defs.setdefault(new, sub)  # (taken: a later definition of another shape gets a name of its own)
            names.append(new)
            renames[f"#/{key}/{_pointer(name)}"] = f"#/$defs/{_pointer(new)}"
        for (_, _, sub), new in zip(own, names):
            defs[new] = _renamed_refs(sub, renames)
        out[tool] = _renamed_refs(schema, renames)
    return out, defs


def _pointer(name: str) -> str:
    """A definition's name as a JSON pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")


def _renamed_refs(value: Any, renames: dict[str, str]) -> Any:
    """A copy of value whose "$ref"s into a renamed definition (it, or a path inside it) point at the new name."""
    if isinstance(value, list):
        return [_renamed_refs(v, renames) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, sub in value.items():
        if key == "$ref" and isinstance(sub, str):
            for old, new in renames.items():
                if sub == old or sub.startswith(old + "/"):
                    sub = new + sub[len(old):]
                    break
            out[key] = sub
        else:
            out[key] = _renamed_refs(sub, renames)
    return out


def template_renders_tools(template: Optional[str]) -> bool:
    return bool(template) and "tools" in template


def chat_messages(messages: list[ChatMessage], tool_plan: Optional[ToolPlan], native: bool,
                  content_text) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Template messages (and apply_chat_template's extra arguments) for a chat with tools or tool results.

    native: the template renders tools itself (it gets `tools` and the calls as data); otherwise the Hermes
    default: a system message with the tools, calls and results written as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        text = content_text(m.content)
        if native:
            item: dict[str, Any] = {"role": role, "content": text}
            if m.tool_calls:
                item["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)}}
                                      for c in m.tool_calls]
            if m.tool_call_id is not None:
                item["tool_call_id"] = m.tool_call_id
            out.append(item)
            continue
        if m.tool_calls:
            calls = "\n".join(f"{CALL_OPEN}\n" + json.dumps({"name": c.function.name,
                                                             "arguments": _loads(c.function.arguments)})
                              + f"\n{CALL_CLOSE}" for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        if role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    kwargs: dict[str, Any] = {}
    if tool_plan is not None:
        if native:
            kwargs["tools"] = tool_plan.tools
        else:
            listing = "\n".join(json.dumps(t) for t in tool_plan.tools)
            system = HERMES_SYSTEM.format(tools=listing)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
            else:
                out.insert(0, {"role": "system", "content": system})
    return out, kwargs


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def parse(tool_plan: ToolPlan, text: str) -> tuple[Optional[str], list[ToolCall]]:
    """(content, tool calls) of a finished reply; the whole text as content when it holds no valid call."""
    calls: list[tuple[str, Any]] = []
    content: Optional[str] = text
    try:
        if tool_plan.mode == "named":
            calls = [(tool_plan.name, json.loads(text))]
            content = None
        elif tool_plan.mode == "required":
            calls = [(item["name"], item["parameters"]) for item in json.loads(text)]
            content = None
        else:
            found = [json.loads(body) for body in _CALL.findall(text)][: None if tool_plan.parallel else 1]
            calls = [(item["name"], item.get("arguments", item.get("parameters", {}))) for item in found]
            if calls:  # the text before the first call, less the whitespace that leads into it
                content = text[: text.index(CALL_OPEN)].rstrip() or None
    except (ValueError, KeyError, TypeError, AttributeError):
        return text, []
    known = {t["function"]["name"] for t in tool_plan.tools}
    if any(not isinstance(name, str) or name not in known for name, _ in calls):
        return text, []
    return content, [ToolCall(id=new_call_id(), function={"name": name, "arguments": json.dumps(args)})
                     for name, args in calls]


def finish_reason(reason: Optional[str], calls: list[ToolCall]) -> Optional[str]:
    return "tool_calls" if calls and reason == "stop" else reason


class ToolStream:
    """One streamed choice of a chat with tools: passes text through until a call may be starting, then holds
    the rest; at the end, the held text becomes tool-call deltas (or content, if it held no valid call).

    The content streamed is exactly the finished reply's (parse): whitespace is held back until text follows
    it, since whitespace right before a call is not content."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.plan = tool_plan
        self.sent = 0  # characters of the reply already sent as content: always a prefix of the raw text
        self.holding = tool_plan.mode != "auto"  # required / named: the whole reply is the calls

    def feed(self, text: str) -> str:
        """The content that can go out now, given the reply so far."""
        if self.holding:
            return ""
        end = text.find(CALL_OPEN, self.sent)
        if end != -1:
            self.holding = True
        else:  # keep back a tail that could be the start of "<tool_call>"
            end = len(text)
            for k in range(min(len(CALL_OPEN) - 1, end - self.sent), 0, -1):
                if text.endswith(CALL_OPEN[:k]):
                    end -= k
                    break
        while end > self.sent and text[end - 1].isspace():  # and the whitespace a call may follow
            end -= 1
        out, self.sent = text[self.sent:end], end
        return out

    def finish(self, text: str, reason: Optional[str]) -> tuple[str, list[DeltaToolCall], Optional[str]]:
        """(remaining content, tool-call deltas, finish reason) once the reply is complete."""
        content, calls = parse(self.plan, text) if reason == "stop" else (text, [])
        if not calls:
            return text[self.sent:], [], reason
        # auto: content is a prefix of the raw text (parse), so `sent` counts into both
        rest = (content or "")[self.sent:] if self.plan.mode == "auto" else ""
        deltas = [DeltaToolCall(index=i, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(calls)]
        return rest, deltas, finish_reason(reason, calls)
