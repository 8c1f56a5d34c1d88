"""--speculative-config, as vLLM spells it: parsed and checked once, at startup."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

# The most tokens a step may propose per sequence: each is a row of the verifying forward.
MAX_SPECULATIVE_TOKENS = 16

_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_num_layers"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How proposals are made: `method` "ngram" (prompt lookup over the prompt and the output so far) or
    "draft_model" (`model`, a checkpoint with the target's tokenizer, run on the same paged engine code with its own
    small KV cache). `draft_num_layers` (pagedserve's, not vLLM's): the draft keeps only the first N decoder layers
    of `model` and its head (a self-speculative draft when `model` is the target)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Optional[str] = None
    draft_num_layers: Optional[int] = None

    @classmethod
    def parse(cls, value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """From the flag's JSON text or a dict; ValueError naming what is wrong (the server exits with it)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON ({exc.msg} at character {exc.pos}).") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: expected a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}.')
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(_KEYS)}.")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: method must be \"ngram\" or \"draft_model\" (or give \"model\"), "
                             f"got {value.get('method')!r}.")
        k = value.get("num_speculative_tokens")
        _int_in("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        kwargs: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
        if method == "ngram":
            if "model" in value or "draft_num_layers" in value:
                raise ValueError("speculative_config: method \"ngram\" takes no model.")
            hi, lo = value.get("prompt_lookup_max", 4), value.get("prompt_lookup_min", 1)
            _int_in("prompt_lookup_max", hi, 1, 64)
            _int_in("prompt_lookup_min", lo, 1, 64)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi}).")
            kwargs.update(prompt_lookup_max=hi, prompt_lookup_min=lo)
        else:
            if not isinstance(value.get("model"), str) or not value["model"]:
                raise ValueError("speculative_config: method \"draft_model\" needs \"model\": a checkpoint path.")
            if "prompt_lookup_max" in value or "prompt_lookup_min" in value:
                raise ValueError("speculative_config: prompt_lookup_* apply to method \"ngram\" only.")
            layers = value.get("draft_num_layers")
            if layers is not None:
                _int_in("draft_num_layers", layers, 1, 1 << 10)
            kwargs.update(model=value["model"], draft_num_layers=layers)
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if v is not None})


def _int_in(name: str, value: Any, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"speculative_config: {name} must be an integer in [{lo}, {hi}], got {value!r}.")
