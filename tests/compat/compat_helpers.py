"""What the compat tests share: the served model's name and how client subprocesses run (offline)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

MODEL = "tiny-llama"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "1", "LANGCHAIN_TRACING_V2": "false"}


def client_env() -> dict[str, str]:
    """The environment of a client subprocess: this one, offline."""
    return {**os.environ, **OFFLINE_ENV}


def venv_bin(name: str) -> str:
    """A console script installed next to this interpreter (the dev extra's clients)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed (pip install -e .[dev])")
    return str(path)
