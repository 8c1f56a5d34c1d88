"""ServerContext: what every handler of one app shares (the engine, the served model's facts); no module globals."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import BaseModel

from engine.frontend.protocol import EngineClient
from server.protocol import unknown_fields

logger = logging.getLogger(__name__)


MAX_STORED_RESPONSES = 1024  # /v1/responses with store: true; the oldest is dropped past this
# Background responses running at once: each holds a task and an engine request that no connection bounds.
MAX_BACKGROUND_RESPONSES = 256
# Unknown field names get a warning each, once, for the first this many names of an endpoint: clients choose the
# names, so past it they are only counted, in a line at most every UNKNOWN_FIELDS_LOG_S seconds per endpoint.
MAX_WARNED_FIELDS = 32
UNKNOWN_FIELDS_LOG_S = 60.0
MAX_LOGGED_NAME = 100  # characters of a field name kept and logged


@dataclass
class StoredResponse:
    """A finished response kept for GET /v1/responses/{id} and previous_response_id."""

    response: Any  # protocol_responses.ResponseObject
    conversation: list[dict[str, str]]  # its input messages and its reply, as chat-template messages


class ResponseStore:
    """The responses clients asked to keep (store: true): in memory, bounded, least recently used dropped first."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class UnknownFieldLog:
    """The warnings about one endpoint's unknown fields: bounded whatever names the clients send."""

    warned: set[str] = field(default_factory=set)  # at most MAX_WARNED_FIELDS names
    unlisted_requests: int = 0  # requests that carried a name past those, since the start
    last_count_log: float = float("-inf")

    def note(self, route: str, names: list[str]) -> None:
        unlisted = False
        for name in names:
            name = name[:MAX_LOGGED_NAME]
            if name in self.warned:
                continue
            if len(self.warned) >= MAX_WARNED_FIELDS:
                unlisted = True
                continue
            self.warned.add(name)
            logger.warning("%s: ignoring the unknown field %r (warned once per field)", route, name)
        if not unlisted:
            return
        self.unlisted_requests += 1
        now = time.monotonic()
        if now - self.last_count_log >= UNKNOWN_FIELDS_LOG_S:
            self.last_count_log = now
            logger.warning("%s: %d request(s) so far carried unknown fields past the first %d names warned about "
                           "(ignored; counted, not logged one by one)", route, self.unlisted_requests,
                           MAX_WARNED_FIELDS)


@dataclass
class ServerContext:
    """The engine and the served model's facts, built once by create_app and read by the handlers."""

    engine: EngineClient
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: Optional[str] = None
    chat_template: Optional[str] = None  # --chat-template; None: the tokenizer's
    tool_call_parser: str = "hermes"  # --tool-call-parser (server/tools.py)
    reasoning_parser: Optional[str] = None  # --reasoning-parser (server/reasoning.py); None: replies are content
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details (cached_tokens), as vLLM's flag
    # --generation-config: SamplingParams fields a request leaves unset default to these (engine/generation_config.py)
    default_sampling: dict[str, Any] = field(default_factory=dict)
    shutdown_timeout_s: float = 10.0  # how long streams may outlive SIGTERM before the engine ends them
    created: int = field(default_factory=lambda: int(time.time()))
    unknown_field_logs: dict[str, UnknownFieldLog] = field(default_factory=dict)  # per route (a handful)
    responses: ResponseStore = field(default_factory=ResponseStore)
    # Background responses still running: id -> (their task, their StoredResponse); server/responses_background.py
    background: dict[str, tuple[Any, StoredResponse]] = field(default_factory=dict)
    max_background: int = MAX_BACKGROUND_RESPONSES  # past it, a new background response is a 503

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def warn_unknown_fields(self, route: str, body: BaseModel) -> None:
        """Log once per (route, field name) the fields of a request that are accepted and ignored (as vLLM does),
        for the first MAX_WARNED_FIELDS names of a route; count the rest."""
        names = unknown_fields(body)
        if names:
            self.unknown_field_logs.setdefault(route, UnknownFieldLog()).note(route, names)
