"""pagedserve's engine: paged KV cache, scheduler, model execution."""
from engine.config import EngineConfig
from engine.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from engine.sequence import CompletionOutput, RequestOutput

__all__ = ["EngineConfig", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "LLM", "LLMEngine"]


def __getattr__(name):  # the heavy modules (torch) load only when asked for
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
