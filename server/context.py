"""ServerContext: what every handler of one app shares (the engine, the served model's facts); no module globals."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import BaseModel

from engine.protocol import EngineClient
from server.protocol import unknown_fields

logger = logging.getLogger(__name__)


MAX_STORED_RESPONSES = 1024  # /v1/responses with store: true; the oldest is dropped past this


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
class ServerContext:
    """The engine and the served model's facts, built once by create_app and read by the handlers."""

    engine: EngineClient
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: Optional[str] = None
    chat_template: Optional[str] = None  # --chat-template; None: the tokenizer's
    tool_call_parser: str = "hermes"  # --tool-call-parser (server/tools.py)
    shutdown_timeout_s: float = 10.0  # how long streams may outlive SIGTERM before the engine ends them
    created: int = field(default_factory=lambda: int(time.time()))
    warned_fields: set[str] = field(default_factory=set)  # "route: field" pairs already logged
    responses: ResponseStore = field(default_factory=ResponseStore)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def warn_unknown_fields(self, route: str, body: BaseModel) -> None:
        """Log once per (route, field name) the fields of a request that are accepted and ignored (as vLLM does)."""
        for name in unknown_fields(body):
            key = f"{route}: {name}"
            if key not in self.warned_fields:
                self.warned_fields.add(key)
                logger.warning("%s: ignoring the unknown field %r (warned once per field)", route, name)
