"""A draft model on the same paged engine code: its own model runner, a small KV cache and block tables of its own.

The draft proposes greedily (its argmax): a point-mass proposal, which the target's acceptance keeps exact for
greedy and sampled requests alike (engine/spec_decode/decoder.py). Per sequence it keeps the K/V of the tokens it
has seen; a step's proposal first catches up on the tokens the target accepted since (one prefill span with a
cached prefix per sequence, whose last row proposes d1), then runs k - 1 one-row decodes for all the sequences at
once. After verification its valid prefix is what both agree on: t, d1..d_accepted (decoder calls accepted()).

`draft_num_layers` N keeps the first N decoder layers of the draft checkpoint and its final norm and head: with
the target's own checkpoint that is a self-speculative draft (layer skipping) sharing the target's weights.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from engine.core.block_allocator import BlockAllocator
from engine.model_executor.layers.attention import AttentionMetadata, PrefillSpan
from engine.sequence import Sequence
from engine.worker.cache_engine import kv_shape
from engine.worker.model_runner import ModelInput, ModelRunner

logger = logging.getLogger(__name__)

DRAFT_CACHE_SHARE = 4  # the draft's KV cache holds 1/this of the target's tokens (at least one full sequence)


class _DraftSeq:
    __slots__ = ("table", "computed", "proposed_from", "pending")

    def __init__(self) -> None:
        self.table: list[int] = []
        self.computed = 0  # leading tokens whose K/V the draft cache holds for this sequence
        self.proposed_from = 0  # the sequence's length at the last proposal
        self.pending = False  # proposed, not yet verified: its K/V past proposed_from holds proposals


class DraftProposer:
    def __init__(self, model: nn.Module, runner: ModelRunner, num_layers: int, num_blocks: int, block_size: int,
                 kv_heads: int, head_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.runner = model, runner
        self.block_size, self.device = block_size, device
        pool = torch.zeros((num_layers, 2, num_blocks, kv_heads, block_size, head_size), dtype=dtype, device=device)
        self.kv_caches = [(pool[layer, 0], pool[layer, 1]) for layer in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks)
        self.seqs: dict[int, _DraftSeq] = {}

    @classmethod
    def build(cls, spec, engine) -> "DraftProposer":
        """The draft for `spec` next to `engine`'s target: the target's own model object when spec.model names the
        target's checkpoint (no second copy of the weights), else the checkpoint loaded alike."""
        from engine.model_executor.loader import load_model

        config = engine.config
        target = engine.model
        same = config.model is not None and Path(spec.model).resolve() == Path(config.model).resolve()
        if same:
            model, hf_config = target, engine.hf_config
        else:
            draft_config = dataclasses.replace(config, model=spec.model, tokenizer=None, speculative_config=None,
                                               quantization=None, served_model_name=None)
            loaded = load_model(draft_config)
            model, hf_config = loaded.model, loaded.hf_config
            if int(hf_config.vocab_size) != engine.vocab_size:
                raise ValueError(f"speculative_config: the draft model's vocabulary ({hf_config.vocab_size}) is not "
                                 f"the target's ({engine.vocab_size}): a draft needs the target's tokenizer.")
        total = len(model.layers)
        layers = spec.draft_num_layers or total
        if layers > total:
            raise ValueError(f"speculative_config: draft_num_layers ({layers}) exceeds the draft model's {total} layers.")
        if layers < total or model is target:
            model = _first_layers(model, layers)  # (a copy also keeps the target's compiled plan its own)
        _, kv_heads, head_size = kv_shape(hf_config)
        bs = config.block_size
        target_blocks = engine.cache_engine.num_device_blocks
        per_seq = -(-config.max_model_len // bs)
        num_blocks = max(per_seq + 1, target_blocks * layers // (total * DRAFT_CACHE_SHARE))
        runner = ModelRunner(config, model, engine.device)
        logger.info("speculative decoding: draft %s, %d of %d layers, %d KV blocks", spec.model, layers, total,
                    num_blocks)
        return cls(model, runner, layers, num_blocks, bs, kv_heads, head_size, engine.dtype, engine.device)

    # -- proposals ---------------------------------------------------------------------

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k tokens for each (sequence, k), greedily from the draft; [] where its cache has no room."""
        bs = self.block_size
        live: list[tuple[int, Sequence, _DraftSeq, int]] = []  # (index in wanted, seq, state, k)
        for i, (seq, k) in enumerate(wanted):
            state = self.seqs.get(seq.seq_id)
            if state is None:
                state = self.seqs[seq.seq_id] = _DraftSeq()
            length = seq.get_len()
            state.computed = min(state.computed, length - 1)
            need = -(-(length + k - 1) // bs) - len(state.table)
            if need > self.allocator.num_free():
                continue
            state.table.extend(self.allocator.allocate() for _ in range(max(need, 0)))
            state.proposed_from, state.pending = length, True
            live.append((i, seq, state, k))
        proposals: list[list[int]] = [[] for _ in wanted]
        if not live:
            return proposals
        # Catch up: each sequence's tokens [computed, L) as a span reading its cached prefix; the last row proposes.
        tokens, positions, slots, spans = [], [], [], []
        for _, seq, state, _ in live:
            ids, start, end = seq.all_token_ids, state.computed, seq.get_len()
            offset = len(tokens)
            tokens += ids[start:end]
            positions += range(start, end)
            slots += [state.table[p // bs] * bs + p % bs for p in range(start, end)]
            table = torch.tensor(state.table[: -(-end // bs)], dtype=torch.int32) if start else None
            spans.append(PrefillSpan(offset, len(tokens), end, table))
        last = [span.end - 1 for span in spans]
        meta = AttentionMetadata(slot_mapping=_t(slots), prefills=spans, num_prefill_tokens=len(tokens))
        drawn = self._argmax(ModelInput(_t(tokens), _t(positions), meta, _t(last), {}))
        for (i, seq, state, _), token in zip(live, drawn):
            proposals[i].append(token)
            state.computed = seq.get_len()
        # Then one decode row per sequence for each further position.
        for step in range(1, max(k for *_, k in live)):
            rows = [(i, seq, state) for i, seq, state, k in live if step < k]
            tokens = [proposals[i][-1] for i, _, _ in rows]
            positions = [seq.get_len() - 1 + step for _, seq, _ in rows]
            slots = [state.table[p // bs] * bs + p % bs for (_, _, state), p in zip(rows, positions)]
            width = max(len(state.table) for _, _, state in rows)
            tables = [state.table + [0] * (width - len(state.table)) for _, _, state in rows]
            meta = AttentionMetadata(slot_mapping=_t(slots), decode_block_tables=_t(tables, torch.int32),
                                     decode_context_lens=_t([p + 1 for p in positions], torch.int32))
            drawn = self._argmax(ModelInput(_t(tokens), _t(positions), meta, _t(list(range(len(rows)))), {}))
            for (i, _, state), token, p in zip(rows, drawn, positions):
                proposals[i].append(token)
                state.computed = p + 1
        return proposals

    def _argmax(self, inp: ModelInput) -> list[int]:
        stats, _ = self.runner.forward(inp, self.kv_caches, greedy=True)
        return stats.argmax.tolist()

    # -- after verification ------------------------------------------------------------

    def accepted(self, seq: Sequence, accepted: int) -> None:
        """The target kept `accepted` of the proposals: the draft's K/V holds t, d1..d_accepted of them."""
        state = self.seqs.get(seq.seq_id)
        if state is None or not state.pending:
            return
        state.pending = False
        if seq.is_finished():
            self.release(seq.seq_id)
            return
        state.computed = min(state.computed, state.proposed_from + accepted)
        keep = -(-seq.get_len() // self.block_size)
        while len(state.table) > keep:
            self.allocator.free(state.table.pop())

    def release(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id, None)
        for block in reversed(state.table if state is not None else []):
            self.allocator.free(block)

    def forget(self, live: set[int]) -> None:
        """Give back the cache of every sequence not in `live` (finished or aborted since)."""
        for seq_id in [s for s in self.seqs if s not in live]:
            self.release(seq_id)


def _t(data: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype)


def _first_layers(model: nn.Module, num_layers: int) -> nn.Module:
    """A shallow copy of a Llama-family model that runs its first `num_layers` layers, then its norm and head
    (the same parameter tensors: no weight is copied)."""
    draft = copy.copy(model)
    draft.__dict__["_modules"] = dict(model._modules)
    draft._modules["layers"] = nn.ModuleList(list(model.layers)[:num_layers])
    draft.args = dataclasses.replace(model.args, layer_windows=tuple(model.args.layer_windows)[:num_layers])
    draft._compiled_plan = None
    return draft
