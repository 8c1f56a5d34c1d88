"""vLLM's --generation-config: the sampling defaults a model's creator recommends in its generation_config.json
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), for what a request leaves unset, and
--override-generation-config over them. No torch: the server reads them too."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from engine.sampling_params import SamplingParams

# generation_config.json's key -> SamplingParams' field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' own defaults: a file that merely repeats them recommends nothing (vLLM reads the diff from them)
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def generation_defaults(model: Optional[str], source: str = "auto",
                        override: Union[None, str, dict[str, Any]] = None) -> dict[str, Any]:
    """The defaults as SamplingParams fields. source "auto": the model folder's generation_config.json (none for a
    .gguf file or a folder without one); "vllm": none (pagedserve's and OpenAI's defaults); else a folder holding a
    generation_config.json. override (a dict or its JSON text, generation_config.json's names) is laid over them.
    ValueError for a folder named without the file, a file that is not a JSON object, or a value no request could
    run with."""
    file_values = _file_values(model, source)
    values = {theirs: v for theirs, v in file_values.items()
              if theirs in KEYS and v is not None and v != _HF_DEFAULTS.get(theirs)}
    where = "the model's generation_config.json" if file_values else ""
    if override:
        extra = _parse_override(override)
        values.update(extra)
        where = f"{where} and --override-generation-config" if where else "--override-generation-config"
    defaults = {KEYS[theirs]: v for theirs, v in values.items()}
    for name, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {name} must be a number, got {value!r}.")
    try:  # a value no request could run with fails the start, not every request that leaves it unset
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return defaults


def _file_values(model: Optional[str], source: str) -> dict[str, Any]:
    if source == "vllm":
        return {}
    folder = Path(source) if source != "auto" else Path(model) if model else None
    if folder is None or not folder.is_dir():
        if source != "auto":
            raise ValueError(f"--generation-config: {source} is not a folder (auto, vllm, or a folder holding a "
                             "generation_config.json).")
        return {}
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"--generation-config: no generation_config.json in {folder}.")
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object.")
    return data


def _parse_override(override: Union[str, dict[str, Any]]) -> dict[str, Any]:
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except ValueError as exc:
            raise ValueError(f"--override-generation-config: not JSON ({exc}).") from None
    if not isinstance(override, dict):
        raise ValueError("--override-generation-config: must be a JSON object.")
    unknown = sorted(set(override) - set(KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key(s) {unknown}; known: {sorted(KEYS)}.")
    return override
