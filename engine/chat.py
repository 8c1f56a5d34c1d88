"""How a chat's messages meet a chat template: content parts given as they are to a template that loops over them,
joined into one string for the others (vLLM's "openai" and "string" content formats). No torch: the server uses it."""
from __future__ import annotations

import re
from typing import Any, Optional

_CONTENT_LOOP = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+(?:message|msg|m)(?:\[['\"]content['\"]\]|\.content\b)")


def iterates_content(template: Optional[str]) -> bool:
    """Whether the template loops over a message's content (list-of-parts content, vLLM's "openai" format); else
    the parts are joined into one string ("string" format)."""
    return bool(template) and _CONTENT_LOOP.search(template) is not None


def template_message(message: dict[str, Any], template: Optional[str]) -> dict[str, Any]:
    """message (a dict) with its list of text parts joined by newlines, unless the template loops over them;
    ValueError for a part that is not text (the models served are text-only)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("chat content parts must be {'type': 'text', 'text': str} (text-only models)")
    if iterates_content(template):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}
