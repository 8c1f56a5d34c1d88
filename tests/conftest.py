"""Session fixtures shared by the suites: the default model folder and a tiny random Llama."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.platform.openmp import apply_serving_default  # no torch import
from tiny_models import save_random_model, tiny_llama_config, tiny_llama_hd64_config

# Never reach a model hub from the tests.
os.environ["HF_HUB_OFFLINE"] = "1"
# OpenMP's idle workers as `pagedserve serve` sets them (server/cli.py), before anything loads torch: the tests,
# and the servers they spawn, run the served setting (unless the environment already chose one, as serve allows).
apply_serving_default()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default SmolLM2 as an HF safetensors folder ($PAGEDSERVE_CACHE or ~/.cache/pagedserve); converted once."""
    from engine.model_executor.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama (GQA, 2 layers, hidden 64) with the default model's tokenizer, as an HF folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    return save_random_model(tiny_llama_config(), folder, default_model_dir)


@pytest.fixture(scope="session")
def tiny_llama_hd64_dir(tmp_path_factory, default_model_dir) -> Path:
    """The tiny random Llama with head_dim 64 (the engine-level CUDA tests' model), as an HF folder."""
    folder = tmp_path_factory.mktemp("tiny-llama-hd64")
    return save_random_model(tiny_llama_hd64_config(), folder, default_model_dir)
