"""A request's structured-output fields -> one GuidedSpec (engine/structured_output/grammars.py compiles it), or a 400."""
from __future__ import annotations

import json
from typing import Any, Optional

from engine.sampling_params import GuidedSpec
from server.errors import APIError
from server.protocol import GuidedFields

_BACKENDS = (None, "auto", "xgrammar")


def guided_spec(body: GuidedFields) -> Optional[GuidedSpec]:
    """The one constraint the body asks for (None: free text). Two at once, or a malformed one, is a 400."""
    if body.guided_decoding_backend not in _BACKENDS:
        raise APIError(f"guided_decoding_backend {body.guided_decoding_backend!r} is not available; this server "
                       "uses xgrammar.", 400, "guided_decoding_backend")
    found: list[tuple[str, GuidedSpec]] = []
    if body.response_format is not None and body.response_format.type != "text":
        found.append(("response_format", _response_format(body)))
    if body.guided_json is not None:
        found.append(("guided_json", GuidedSpec("json", _schema_text(body.guided_json, "guided_json"))))
    if body.guided_regex is not None:
        found.append(("guided_regex", GuidedSpec("regex", body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", GuidedSpec.choice(body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", GuidedSpec("grammar", body.guided_grammar)))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(body)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(f"Only one structured-output constraint may be given; got {names}.", 400, found[1][0])
    return found[0][1] if found else None


def guided_param(body: GuidedFields) -> str:
    """The field a compile error is reported against."""
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs"):
        value = getattr(body, name)
        if value is not None and not (name == "response_format" and value.type == "text"):
            return name
    return "response_format"


def _response_format(body: GuidedFields) -> GuidedSpec:
    fmt = body.response_format
    if fmt.type == "json_object":
        return GuidedSpec("json_object")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError("response_format of type json_schema needs json_schema.schema.", 400, "response_format")
    return GuidedSpec("json", _schema_text(fmt.json_schema.schema_, "response_format"))


def _structured_outputs(body: GuidedFields) -> GuidedSpec:
    so = body.structured_outputs
    given = [name for name in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, name)]
    if len(given) != 1:
        raise APIError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object.", 400,
                       "structured_outputs")
    kind = given[0]
    if kind == "json_":
        return GuidedSpec("json", _schema_text(so.json_, "structured_outputs"))
    if kind == "choice":
        return GuidedSpec.choice(so.choice)
    if kind == "json_object":
        return GuidedSpec("json_object")
    return GuidedSpec(kind, getattr(so, kind))


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text; it must be an object (or true)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise APIError(f"{param}: the schema is not valid JSON ({exc}).", 400, param) from None
    if not isinstance(schema, (dict, bool)):
        raise APIError(f"{param}: a JSON schema is an object, got {type(schema).__name__}.", 400, param)
    return json.dumps(schema)
