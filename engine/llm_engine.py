"""LLMEngine: one step = schedule -> cache moves -> forward -> sample -> outputs."""
from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch

from engine import ops
from engine.cache_engine import CacheEngine, determine_num_blocks
from engine.config import EngineConfig
from engine.loader import load_model, model_max_len
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.prompt_logprobs import add_prompt_logprobs
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import RequestOutput, Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot for /metrics and the periodic log line."""

    num_running: int
    num_waiting: int
    num_swapped: int
    device_cache_usage: float
    cpu_cache_usage: float
    prefix_cache_hit_rate: float
    num_device_blocks: int
    num_cpu_blocks: int
    block_size: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prompt_tokens_total: int
    generation_tokens_total: int


class LLMEngine:
    """The synchronous engine: add requests, call step() until they finish."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        loaded = load_model(config)
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        self.device, self.dtype = loaded.device, loaded.dtype
        config.resolve(model_max_len(self.hf_config))
        self.model_runner = ModelRunner(config, self.model, self.device)
        # Build/load the kernels now: loading imports torch.utils.cpp_extension (setuptools, ~0.3 s
        # holding the GIL), which in the first step would stall a server's event loop.
        ops.backend()
        num_device_blocks, num_cpu_blocks = determine_num_blocks(
            config, self.hf_config, self.dtype, self.device, profile=self.model_runner.profile_run
        )
        self.cache_engine = CacheEngine(
            config.block_size, self.hf_config, num_device_blocks, num_cpu_blocks, self.device, self.dtype
        )
        # The model's window (every layer's) lets the block manager release blocks the attention no longer reads.
        self.scheduler = Scheduler(config, num_device_blocks, num_cpu_blocks, sliding_window=self.model.kv_window)
        self.eos_token_id: Optional[int] = self.tokenizer.eos_token_id
        self.vocab_size = int(self.hf_config.vocab_size)
        self.sampler = Sampler(eos_token_id=self.eos_token_id)
        self.seq_counter = itertools.count()
        self.output_processor = OutputProcessor(self.tokenizer, config.max_model_len, self.eos_token_id,
                                                self.seq_counter)
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._preempted_recompute = 0
        self._preempted_swap = 0
        # What loading left (torch, transformers, the model: ~400k objects) never becomes garbage; a
        # full collection walking it takes ~0.2 s with the GIL held. Freezing it keeps them cheap.
        gc.collect()
        gc.freeze()

    # -- requests -------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def add_request(
        self,
        request_id: str,
        prompt: Optional[str] = None,
        prompt_token_ids: Optional[list[int]] = None,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
    ) -> None:
        """Queue one request. ValueError for an empty prompt or token ids outside the vocabulary.

        `params` is read, never changed (one object may serve many requests); max_tokens None generates until
        the context (max_model_len) is full. With --scheduling-policy priority a lower `priority` runs first.
        """
        params = params if params is not None else SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt: either a prompt or prompt_token_ids is required.")
            prompt_token_ids = self.tokenize(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt: the prompt is empty.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is out of vocabulary (size {self.vocab_size}).")
        seq = Sequence(next(self.seq_counter), list(prompt_token_ids))
        group = SequenceGroup(request_id, [seq], params, arrival_time, priority, prompt)
        self.scheduler.add_seq_group(group)

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> list[SequenceGroup]:
        """End requests in whichever queue they are; their blocks go back to the pool."""
        return self.scheduler.abort_seq_group(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # -- the step -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward over the batch, sample, and report every touched request."""
        out = self.scheduler.schedule()
        self._preempted_recompute += out.num_preempted_recompute
        self._preempted_swap += out.num_preempted_swap
        now = time.monotonic()
        outputs = []
        for group in out.ignored:
            group.metrics.finished_time = now
            outputs.append(self.output_processor.to_request_output(group))
        self.cache_engine.apply(out)
        if not out.scheduled:
            return outputs

        # A prompt chunk short of the prompt's end (chunked prefill) samples nothing and reports nothing yet.
        rows = [(sg.group, sg.group.get_seqs(SequenceStatus.RUNNING)) for sg in out.scheduled if sg.do_sample]
        self._prompt_tokens_total += sum(sg.num_tokens for sg in out.scheduled if sg.is_prefill)
        logits, prompt_logits = self.model_runner.execute(out, self.cache_engine.device_cache)
        add_prompt_logprobs(out, prompt_logits)
        self.scheduler.update_computed(out)
        samples = self.sampler(logits, rows)
        self._generation_tokens_total += sum(len(seqs) for _, seqs in rows)

        for (group, _), group_samples in zip(rows, samples):
            self.scheduler.apply(self.output_processor.process(group, group_samples))
            if group.is_finished():
                group.metrics.finished_time = time.monotonic()
            outputs.append(self.output_processor.to_request_output(group))
        self.scheduler.free_finished_seq_groups()
        return outputs

    def get_stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            device_cache_usage=bm.device_usage(),
            cpu_cache_usage=bm.cpu_usage(),
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate(),
            num_device_blocks=self.cache_engine.num_device_blocks,
            num_cpu_blocks=self.cache_engine.num_cpu_blocks,
            block_size=self.config.block_size,
            num_preemptions_recompute=self._preempted_recompute,
            num_preemptions_swap=self._preempted_swap,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )

