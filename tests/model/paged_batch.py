"""A hand-driven paged batch for model tests: sequences, block tables and SchedulerOutputs without a scheduler."""
from __future__ import annotations

import itertools

import torch

from engine.worker.cache_engine import CacheEngine
from engine.config import EngineConfig
from engine.model_executor.loader import LoadedModel
from engine.worker.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledGroup, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus


class PagedBatch:
    """Owns a CacheEngine and a free list of blocks; runs groups through the real ModelRunner."""

    def __init__(self, loaded: LoadedModel, block_size: int = 8, num_blocks: int = 64) -> None:
        config = EngineConfig(block_size=block_size, device="cpu", dtype="float32")
        self.block_size = block_size
        self.cache = CacheEngine(block_size, loaded.hf_config, num_blocks, 8, loaded.device, loaded.dtype)
        self.runner = ModelRunner(config, loaded.model, loaded.device)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        self._ids = itertools.count()

    def add(self, token_ids: list[int], prompt_logprobs=None, prefix_blocks=(), num_computed: int = 0) -> SequenceGroup:
        """A running one-sequence group; prefix_blocks/num_computed model a prefix-cache hit."""
        seq = Sequence(next(self._ids), list(token_ids))
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = num_computed
        self.tables[seq.seq_id] = list(prefix_blocks)
        params = SamplingParams(temperature=0.0, prompt_logprobs=prompt_logprobs)
        return SequenceGroup(f"req-{seq.seq_id}", [seq], params)

    def step(self, groups: list[SequenceGroup]):
        """One forward over the groups (prefill or decode, as their sequences stand); marks them computed."""
        scheduled = []
        for g in groups:
            seq = g.seqs[0]
            table = self.tables[seq.seq_id]
            while len(table) * self.block_size < seq.get_len():
                table.append(self.free.pop())
            n = seq.num_uncomputed_tokens()
            is_decode = n == 1 and seq.get_output_len() > 0  # this harness plays the scheduler
            scheduled.append(ScheduledGroup(g, not is_decode, n))
        out = SchedulerOutput(scheduled=scheduled, block_tables={s.group.seqs[0].seq_id: self.tables[s.group.seqs[0].seq_id] for s in scheduled})
        logits, prompt_logits = self.runner.execute(out, self.cache.device_cache)
        for g in groups:
            g.seqs[0].num_computed_tokens = g.seqs[0].get_len()
        return logits, prompt_logits


def append_greedy(groups: list[SequenceGroup], logits: torch.Tensor) -> None:
    """Append each row's argmax to its group's sequence."""
    for g, row in zip(groups, logits):
        token = int(row.argmax())
        g.seqs[0].append_token(token, {token: 0.0})


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:  # [len, vocab] float32
    return hf_model(torch.tensor([token_ids])).logits[0].float()
