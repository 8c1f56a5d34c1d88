"""The engine is a library: building and running one leaves the process's environment, torch's global random
state and the garbage collector as they were; --seed reaches sampling through the engine's own generator."""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from engine.platform.openmp import SERVING_OPENMP_ENV
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_engine_and_server_sets_no_environment_variable():
    # Without the OpenMP variables `pagedserve serve` sets (engine/platform/openmp.py, from its entry point only), which the
    # suite's own environment carries (tests/conftest.py): importing must not set them, nor anything else.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", *SERVING_OPENMP_ENV)}
    code = ("import json, os; before = dict(os.environ)\n"
            "import engine, engine.llm, engine.llm_engine, engine.frontend.async_engine, server.app, server.cli\n"
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


def test_an_engine_leaves_process_state_alone_and_seeds_its_own_sampling(tiny_llama_dir, monkeypatch):
    from engine import LLM

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    env, rng, frozen = dict(os.environ), torch.random.get_rng_state(), gc.get_freeze_count()
    kwargs = dict(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=32,
                  num_cpu_blocks_override=0, max_model_len=64, seed=7)
    first = LLM(**kwargs)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)  # unseeded: the engine's generator
    a = first.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)
    assert dict(os.environ) == env
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert gc.get_freeze_count() == frozen
    torch.rand(100)  # whatever else the process draws does not change what the engine samples
    b = LLM(**kwargs).generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_an_engine_resolves_its_own_copy_of_the_config(tiny_llama_dir):
    # The fields the device and the model decide stay unset in the caller's config: a second engine from it (on
    # another device, say, where a CPU block size of 128 is refused) resolves them afresh.
    from engine import LLMEngine
    from engine.config import CPU_BLOCK_SIZE, EngineConfig

    config = EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks_override=32, num_cpu_blocks_override=0)
    before = dataclasses.replace(config)
    first = LLMEngine(config)
    assert config == before and config.block_size is None and config.max_model_len is None
    assert first.config.block_size == CPU_BLOCK_SIZE and first.config.max_model_len is not None
    second = LLMEngine(config)
    assert config == before and second.config == first.config and second.config is not first.config
