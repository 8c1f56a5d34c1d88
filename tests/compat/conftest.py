"""The compat suite: third-party clients (guidellm, lm-eval, LangChain, AsyncOpenAI) against one real server.

The server is uvicorn on 127.0.0.1 around the real engine and the tiny random Llama (the default model's
tokenizer), so the suite checks protocol and numbers, not text quality, in seconds. Every client runs offline:
HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, tokenizers and tasks from local folders.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from compat_helpers import MODEL

# The server tests' harness (ServerThread, wait_idle) is shared, not copied.
sys.path.append(str(Path(__file__).resolve().parents[1] / "server"))


@pytest.fixture(scope="session")
def compat_server(tiny_llama_dir):
    """The tiny Llama served as MODEL: 64 sequences a batch, room for 64 short streams at once."""
    from engine.frontend.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from serving_harness import ServerThread

    from server.app import create_app

    config = EngineConfig(model=str(tiny_llama_dir), served_model_name=MODEL, max_model_len=256, max_num_seqs=64,
                          block_size=16, num_gpu_blocks_override=512, num_cpu_blocks_override=64, seed=0)
    engine = AsyncLLMEngine.from_config(config, log_stats=False)
    with ServerThread(create_app(engine)) as server:
        server.engine = engine
        server.model_dir = tiny_llama_dir
        yield server
