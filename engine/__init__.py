"""pagedserve's engine: paged KV cache, scheduler, model execution."""
import os

# OpenMP threads that spin at barriers (libgomp's default) steal the core from the
# thread still working as soon as anything else runs: the server's event loop, the
# client, a neighbour. On a 2-core machine that made decode steps 5-10x slower;
# passive waiting keeps them at the one-thread speed or better (docs/benchmarks.md).
# libgomp reads this once, when torch loads it, so it must be set before torch is
# imported; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.sequence import CompletionOutput, RequestOutput

__all__ = ["EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "LLM", "LLMEngine"]


def __getattr__(name):  # the heavy modules (torch) load only when asked for
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
