"""What every rank holds, built the same way on each: its shard of the model, a ModelRunner and its KV cache.

Use (the engine on rank 0, the worker loop on the others; under tensor parallelism every rank in step, since
sizing the cache may run a profiled forward and takes the smallest block count over the ranks):

    rank = RankState.build(config, tp)
    rank.runner.forward(inp, rank.cache_engine.device_cache)
"""
from __future__ import annotations

from dataclasses import dataclass

from engine import ops
from engine.worker.cache_engine import CacheEngine, determine_num_blocks, kv_shape
from engine.config import EngineConfig
from engine.distributed.group import TPGroup
from engine.model_executor.loader import LoadedModel, load_model, model_max_len
from engine.worker.model_runner import ModelRunner


@dataclass
class RankState:
    """One rank's model, runner and cache."""

    loaded: LoadedModel
    runner: ModelRunner
    cache_engine: CacheEngine

    @classmethod
    def build(cls, config: EngineConfig, tp: TPGroup) -> "RankState":
        """Resolves `config` in place (max_model_len, the batch budget): pass the engine's or rank's own copy."""
        loaded = load_model(config, tp=tp)
        hf_config = loaded.hf_config
        _, kv_heads, head_size = kv_shape(hf_config, tp.world_size)
        ops.check_attention_geometry(loaded.device, hf_config.num_attention_heads // tp.world_size, kv_heads,
                                     head_size)
        config.resolve(model_max_len(hf_config))
        runner = ModelRunner(config, loaded.model, loaded.device)
        num_device_blocks, num_cpu_blocks = determine_num_blocks(config, hf_config, loaded.dtype, loaded.device,
                                                                 profile=runner.profile_run)
        num_device_blocks = tp.min_int(num_device_blocks)  # the block tables are shared: every rank holds them all
        cache_engine = CacheEngine(config.block_size, hf_config, num_device_blocks, num_cpu_blocks, loaded.device,
                                   loaded.dtype, tp.world_size)
        return cls(loaded, runner, cache_engine)
