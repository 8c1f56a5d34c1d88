"""Fixtures for the server tests: the default model's tokenizer, and a fake-engine server for HTTP-layer tests."""
from __future__ import annotations

import os
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (from the GGUF that ships the default model)."""
    from serving_harness import load_smol_tokenizer

    return load_smol_tokenizer()


@pytest.fixture(scope="module")
def fake_server(smol_tokenizer):
    """A real uvicorn server around the deterministic fake engine (HTTP-layer tests only)."""
    from engine.async_engine import AsyncLLMEngine
    from server.app import create_app
    from fake_llm_engine import FakeLLMEngine
    from serving_harness import ServerThread

    engine = AsyncLLMEngine(FakeLLMEngine(smol_tokenizer, max_model_len=256, max_num_seqs=4), log_stats=False)
    with ServerThread(create_app(engine)) as server:
        server.engine = engine
        yield server
