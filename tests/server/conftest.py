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


def _real_server(**engine_kwargs):
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from server.app import create_app
    from serving_harness import ServerThread

    # Small context and cache: fast to allocate, and the default SmolLM2 weights are the real thing.
    config = EngineConfig(max_model_len=512, kv_cache_space=0.25, swap_space=0.25, **engine_kwargs)
    engine = AsyncLLMEngine.from_config(config, log_stats=False)
    return engine, ServerThread(create_app(engine))


@pytest.fixture(scope="session")
def real_server():
    """uvicorn on 127.0.0.1 serving the default SmolLM2 model with the real engine."""
    engine, server = _real_server(max_num_seqs=64)
    with server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def tiny_batch_server():
    """The real engine with max_num_seqs=2, so further requests queue in `waiting`."""
    engine, server = _real_server(max_num_seqs=2)
    with server:
        server.engine = engine
        yield server
