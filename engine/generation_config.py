"""vLLM's --generation-config: the sampling defaults a model's creator recommends in its generation_config.json
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), for what a request leaves unset. No torch:
the server reads them too."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from engine.sampling_params import SamplingParams

# generation_config.json's key -> SamplingParams' field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' own defaults: a file that merely repeats them recommends nothing (vLLM reads the diff from them)
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def generation_defaults(model: Optional[str], source: str = "auto") -> dict[str, Any]:
    """The defaults as SamplingParams fields. source "auto": the model folder's generation_config.json (none for a
    .gguf file or a folder without one); "vllm": none (pagedserve's and OpenAI's defaults); else a folder holding a
    generation_config.json. ValueError for a folder named without one, or a file that is not a JSON object."""
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
    defaults = {ours: data[theirs] for theirs, ours in KEYS.items()
                if data.get(theirs) is not None and data[theirs] != _HF_DEFAULTS.get(theirs)}
    for name, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}.")
    try:  # a value no request could run with fails the start, not every request that leaves it unset
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc} (--generation-config vllm leaves the file out)") from exc
    return defaults
