"""Fixtures for the server tests: real uvicorn servers around the real engine, over a tiny random Llama or SmolLM2."""
from __future__ import annotations

import os
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_llama_dir):
    """AsyncLLMEngine(LLMEngine) over the tiny random Llama, served as bad_inputs.MODEL; builds in about a second."""
    from bad_inputs import MODEL
    from engine.frontend.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig

    def make(**overrides):
        fields = dict(model=str(tiny_llama_dir), served_model_name=MODEL, max_model_len=256, max_num_seqs=4,
                      block_size=16, num_gpu_blocks_override=128, num_cpu_blocks_override=64, seed=0)
        return AsyncLLMEngine.from_config(EngineConfig(**{**fields, **overrides}), log_stats=False)

    return make


@pytest.fixture(scope="module")
def tiny_server(make_tiny_engine):
    """uvicorn on 127.0.0.1 around the real engine and the tiny Llama: max_model_len 256, max_num_seqs 4."""
    from server.app import create_app
    from serving_harness import ServerThread

    engine = make_tiny_engine()
    with ServerThread(create_app(engine)) as server:
        server.engine = engine
        yield server


def _real_server(**engine_kwargs):
    from engine.frontend.async_engine import AsyncLLMEngine
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


@pytest.fixture(scope="module")
def chunked_real_server():
    """The real engine with chunked prefill and a 16-token budget: longer prompts take several steps."""
    engine, server = _real_server(max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=16)
    with server:
        server.engine = engine
        yield server
