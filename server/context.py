"""ServerContext: what every handler of one app shares (the engine, the served model's facts); no module globals."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import BaseModel

from server.protocol import unknown_fields

logger = logging.getLogger(__name__)


@dataclass
class ServerContext:
    """The engine and the served model's facts, built once by create_app and read by the handlers."""

    engine: Any  # AsyncLLMEngine
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: Optional[str] = None
    shutdown_timeout_s: float = 10.0  # how long streams may outlive SIGTERM before the engine ends them
    created: int = field(default_factory=lambda: int(time.time()))
    warned_fields: set[str] = field(default_factory=set)  # "route: field" pairs already logged

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
