"""SchedulerOutput -> flattened input tensors + attention metadata -> model -> logits.

Use (the engine, each step, after cache_engine.apply(out)):

    runner = ModelRunner(config, model, device)
    logits, prompt_logits = runner.execute(out, cache_engine.device_cache)
    # logits: [num_rows, vocab] float32, one row per RUNNING sequence of each scheduled group, in order
    # prompt_logits: {request_id: [num_prompt_tokens_computed, vocab]} for prefills asking prompt_logprobs

Under tensor parallelism the driver (rank 0) runs execute(); `runner.workers` (engine/worker/tp_workers.py) hands
each step's ModelInput to the other ranks, which run forward() on it in lockstep (their logits are None).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from engine import ops
from engine.model_executor.layers.attention import Attention, AttentionMetadata, KVCache, PrefillSpan
from engine.config import EngineConfig
from engine.distributed.group import TPGroup
from engine.model_executor.layers.prefill_kernels import PrefillBatch, ProbeShape, candidates_for, select_prefill_kernel
from engine.sample.prompt_logprobs import logits_positions
from engine.worker.cuda_graphs import DecodeGraphs, maybe_capture
from engine.platform.memory import find_malloc_trim
from engine.sample.sampler import GreedyStats
from engine.sequence import Sequence, SequenceGroup, SequenceStatus


# A CPU decode batch is split across the cores when each shard gets at least this many sequences:
# each core runs the whole model on its shard, one OpenMP thread each (see ModelRunner._split_decode).
# Since the small-row GEMMs share their pieces between the threads and a step's layers run as one C++ loop, one
# forward on both threads is the faster at 16 to 24 sequences (bfloat16 at 16: 25.1 against 27.0 ms a step,
# at 24: 31.2 against 33.3; float32 at 16: 40.5 against 43.4; in-process A/B on a Zen 4). Each shard reads every
# weight, which costs more where the multiply-adds are cheaper: with 128-token KV blocks bfloat16 at 32 ran
# 34.6 / 45.9 ms as one forward against 36.3 / 47.8 split, and 48.9 against 47.9 at 40; float32 at 32 70.3
# against 67.7 (split). So float32 splits from 32 sequences, bfloat16 from 40.
SPLIT_MIN_ROWS = 16
SPLIT_MIN_ROWS_BF16 = 20
# At most this many shards: each one reads every weight; more is untested (docs/benchmarks.md measured 2).
SPLIT_MAX_SHARDS = 2
_SPLIT_ENV = "PAGEDSERVE_SPLIT_DECODE"  # 0: one forward per step, as on CUDA (A/B comparisons)
# After a CPU step with this many prefill tokens the heap is trimmed (malloc_trim): a prefill's temporaries are
# larger and of other sizes than a decode step's, and glibc keeps what they freed in its arenas (its mmap threshold
# rises to 32 MiB once a large block was freed). One 128-token prompt of a 1.17B left ~60 MiB resident that way.
TRIM_AFTER_PREFILL_TOKENS = 32


def _no_fault(stage: str) -> None:
    pass


class _Row(NamedTuple):
    seq: Sequence
    group: SequenceGroup
    start: int  # first token computed this step (== seq.num_computed_tokens)
    end: int  # where this step's computed tokens end (ScheduledGroup.span_end)
    logits_row: Optional[int]  # its row of the step's logits, in the scheduler's order; None: not sampled


class ModelInput(NamedTuple):
    """Everything one forward needs, built from a SchedulerOutput."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_rows] int64: each sampled row's last token, in the scheduler's row order
    prompt_rows: dict[str, tuple[int, int]]  # request_id -> token range [a, b) whose logits are prompt logits

    def to(self, device: torch.device) -> "ModelInput":
        """The same input on `device` (tensor parallelism ships it on the CPU: one pickled broadcast)."""
        if self.input_ids.device == device:
            return self
        m = self.meta
        move = (lambda t: None if t is None else t.to(device, non_blocking=True))
        spans = [PrefillSpan(p.start, p.end, p.context_len, move(p.block_table)) for p in m.prefills]
        meta = AttentionMetadata(
            slot_mapping=move(m.slot_mapping), prefills=spans, num_prefill_tokens=m.num_prefill_tokens,
            decode_block_tables=move(m.decode_block_tables), decode_context_lens=move(m.decode_context_lens),
        )
        return ModelInput(move(self.input_ids), move(self.positions), meta, move(self.logits_indices),
                          self.prompt_rows)


class DecodeBatch:
    """The input of a steady decode (engine/core/scheduler.py's SteadyDecode), kept between its steps.

    Each step every row moves one position on: its position, context length and slot grow by one, its token is
    the one sampled for it in the step before (`record_sampled`), and only the rows entering a new block
    (`SchedulerOutput.steady_grown`) read their block table again. Nothing is rebuilt from the sequences.
    """

    def __init__(self, version: int, steps: int, inp: ModelInput, block_size: int) -> None:
        self.version, self.steps, self.inp, self.block_size = version, steps, inp, block_size
        self.next_tokens: Optional[np.ndarray] = None  # [num_rows] int64, sampled in the last step (on the host)
        # The CPU input's arrays, moved on through NumPy views of the same memory: at a decode step's few rows an
        # in-place torch op costs its dispatch, several times NumPy's call.
        meta = inp.meta
        self._arrays = (inp.input_ids.numpy(), inp.positions.numpy(), meta.decode_context_lens.numpy(),
                        meta.slot_mapping.numpy())

    def advance(self, out) -> ModelInput:
        """The next step's input: every row one token on, in place."""
        steady, inp, bs = out.steady, self.inp, self.block_size
        meta = inp.meta
        input_ids, positions, context_lens, slots = self._arrays
        if self.next_tokens is not None:
            input_ids[:] = self.next_tokens
        else:  # the engine did not hand the step's tokens over (a caller of the runner alone)
            input_ids[:] = [seq.get_last_token_id() for _, seq in steady.rows]
        self.next_tokens = None
        positions += 1
        context_lens += 1
        slots += 1  # the next slot of the same block, except for the rows entering a new one
        if out.steady_grown:
            tables = meta.decode_block_tables
            width = max(len(out.block_tables[steady.rows[row][1].seq_id]) for row in out.steady_grown)
            if width > tables.shape[1]:
                wider = torch.zeros(tables.shape[0], width, dtype=tables.dtype, device=tables.device)
                wider[:, : tables.shape[1]] = tables
                tables = meta.decode_block_tables = wider
            table_rows = tables.numpy()
            for row in out.steady_grown:
                table = out.block_tables[steady.rows[row][1].seq_id]
                position = int(positions[row])
                table_rows[row, : len(table)] = table
                slots[row] = table[position // bs] * bs + position % bs
        self.steps = steady.steps
        return inp


class ModelRunner:
    """Runs the model on the sequences a SchedulerOutput schedules; prefill and decode alike."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
        self.config, self.model, self.device = config, model, torch.device(device)
        self.block_size = config.block_size
        self.tp: TPGroup = getattr(model, "tp", None) or TPGroup.single()
        # Tensor parallelism: the step's input is built on the CPU, broadcast, then moved by each rank.
        self._input_device = torch.device("cpu") if self.tp.world_size > 1 else self.device
        self.workers = None  # the driver's handle on the other ranks (engine/worker/tp_workers.py), under TP
        self._threads = torch.get_num_threads()
        # The ranks' collectives must run in one order: under TP a step is one forward.
        self._split = (self.device.type == "cpu" and self._threads > 1 and os.environ.get(_SPLIT_ENV, "1") != "0"
                       and ops.backend() is ops.OpsBackend.COMPILED_CPU and self.tp.group is None)
        self._shard_pool: Optional[ThreadPoolExecutor] = None  # started on the first split step
        dtype = self._dtype = next(model.parameters(), torch.empty(0)).dtype
        self._split_min_rows = SPLIT_MIN_ROWS_BF16 if dtype == torch.bfloat16 else SPLIT_MIN_ROWS
        # CUDA: the batched prefill kernel that runs here, probed once on this device (engine/model_executor/layers/prefill_kernels.py).
        attn = next((m for m in model.modules() if isinstance(m, Attention)), None)
        candidates = candidates_for(self.device) if attn is not None else []
        self.prefill_kernel = select_prefill_kernel(candidates, ProbeShape(
            attn.num_heads, attn.num_kv_heads, attn.head_size, dtype, self.device)) if candidates else None
        self.batch: Optional[DecodeBatch] = None  # the steady decode's input, kept between its steps
        # True (the engine, which reads a step's logits before the next step): the head writes each step's logits
        # into one kept buffer instead of a fresh [rows, vocab] allocation whose pages fault in every step.
        self.reuse_logits = False
        self._logits_buffer: Optional[torch.Tensor] = None
        self._trim_heap = find_malloc_trim() if self.device.type == "cpu" else None
        self.graphs: Optional[DecodeGraphs] = None  # CUDA: the decode steps' graphs (capture_graphs)
        self._drafting = False  # this step verifies proposals (SchedulerOutput.drafts)

    def capture_graphs(self, kv_caches: list[KVCache]) -> None:
        """Captures the decode-only steps' CUDA graphs against this cache (engine/worker/cuda_graphs.py), where
        they serve; again after the cache was reallocated. With graphs, a step's input is built on the host (the
        steady decode's batch moves on there, as on the CPU) and staged into the graphs' buffers."""
        self.graphs = None  # the old graphs hold the old cache's addresses and their pool
        self.graphs = maybe_capture(self.model, kv_caches, self.config, self.device, self.tp.world_size)
        if self.graphs is not None:
            self._input_device = torch.device("cpu")
            self.batch = None

    def _logits_out(self, rows: int) -> Optional[torch.Tensor]:
        """[rows, vocab] float32 of the kept buffer, or None (not reusing, or not on the CPU)."""
        if not self.reuse_logits or self.device.type != "cpu" or self.tp.world_size > 1:
            return None
        buf = self._logits_buffer
        if buf is None or buf.shape[0] < rows:
            buf = self._logits_buffer = torch.empty(max(rows, 2 * (buf.shape[0] if buf is not None else 0)),
                                                    self.model.args.vocab_size, dtype=torch.float32)
        return buf[:rows]

    def record_sampled(self, token_ids: np.ndarray) -> None:  # [num_rows] int64, in the step's row order
        """The tokens sampled in this step: the next step's input if it continues the steady decode."""
        if self.batch is not None and token_ids.shape[0] == self.batch.inp.input_ids.shape[0]:
            self.batch.next_tokens = token_ids

    def execute(self, out, kv_caches: list[KVCache], at: Callable[[str], None] = _no_fault, greedy: bool = False,
                ) -> tuple[torch.Tensor | GreedyStats, dict[str, torch.Tensor]]:
        """Forward the tokens [num_computed_tokens, get_len()) of every RUNNING sequence of out.scheduled.

        A prompt chunk (ScheduledGroup.do_sample False) computes only its num_tokens and gets no logits row.
        `at(stage)` is called as each stage starts ("prepare_inputs", "forward"; engine/faults.py).
        greedy (every row greedy, no top logprobs, nothing adjusting the logits): the rows' GreedyStats instead of
        their logits, from a head that does not write them where the model has one; logits still under tensor
        parallelism and for a step with prompt logprobs."""
        # The guard torch.inference_mode() enters, held directly: the decorator builds, enters and leaves a context
        # object through several Python calls, a share of a small batch's step that shows.
        with torch._C._InferenceMode(True):
            return self._execute(out, kv_caches, at, greedy)

    def _execute(self, out, kv_caches: list[KVCache], at: Callable[[str], None], greedy: bool,
                 ) -> tuple[torch.Tensor | GreedyStats, dict[str, torch.Tensor]]:
        at("prepare_inputs")
        self._drafting = bool(getattr(out, "drafts", None))
        inp = self.prepare(out)
        at("forward")
        if self.workers is not None:  # the other ranks apply the step's cache moves and join this forward
            self.workers.send_step(out, inp)
        if inp is None:
            return torch.empty(0, 0, dtype=torch.float32, device=self.device), {}
        if self.workers is not None:
            try:
                return self.forward(inp, kv_caches)
            except Exception as exc:  # the others may wait in a collective this rank never reaches: fatal
                raise self.workers.fatal(exc) from exc
        greedy = greedy and not inp.prompt_rows
        shards = self._num_shards(inp)
        if shards > 1:
            return self._split_decode(inp, kv_caches, shards, greedy), {}
        result = self._forward(inp, kv_caches, greedy)  # (in inference mode already: forward would enter it again)
        if self._trim_heap is not None and inp.meta.num_prefill_tokens >= TRIM_AFTER_PREFILL_TOKENS:
            self._trim_heap(0)  # 0.3 ms after a 90 ms SmolLM2 128-token prefill, 1.1 ms after a 550 ms 1.17B one
        return result

    @torch.inference_mode()
    def forward(self, inp: ModelInput, kv_caches: list[KVCache], greedy: bool = False,
                ) -> tuple[Optional[torch.Tensor | GreedyStats], dict[str, Optional[torch.Tensor]]]:
        """One forward of a prepared input; every rank runs it (logits are None except on rank 0). greedy (one
        rank, no prompt rows): GreedyStats instead of logits (execute)."""
        return self._forward(inp, kv_caches, greedy)

    def _forward(self, inp: ModelInput, kv_caches: list[KVCache], greedy: bool = False,
                 ) -> tuple[Optional[torch.Tensor | GreedyStats], dict[str, Optional[torch.Tensor]]]:
        graphs = self.graphs
        if graphs is not None and kv_caches is graphs.kv_caches and graphs.serves(inp.input_ids, inp.meta):
            logits = graphs.run(inp.input_ids, inp.positions, inp.meta, kv_caches)  # decode rows, in order
            return (GreedyStats.of(logits) if greedy else logits), {}
        inp = inp.to(self.device)
        meta = inp.meta
        meta.prefill_batch = self._prefill_batch(meta.prefills)
        hidden = self.model(inp.input_ids, inp.positions, kv_caches, meta)  # [num_tokens, hidden]
        rows = inp.logits_indices.shape[0]
        # A decode-only step samples every token, in order (_build): its logits_indices are arange(num_tokens), and
        # gathering the rows would only copy them.
        last = hidden if not meta.num_prefill_tokens and rows == hidden.shape[0] else hidden[inp.logits_indices]
        if greedy:
            return self._greedy_stats(last, lambda: self._logits_out(rows)), {}
        logits = self.model.compute_logits(last, self._logits_out(rows))  # [num_rows, vocab]
        prompt_logits = {rid: self.model.compute_logits(hidden[a:b]) for rid, (a, b) in inp.prompt_rows.items()}
        return logits, prompt_logits

    # ---- CPU decode split across cores ------------------------------------------------------------------
    # A decode step at batch 32 runs ~120 small GEMMs; with the OpenMP team on every one, the two threads meet at
    # a barrier ~150 times a step (a wait on the slower one each time, and a wake-up of tens of microseconds on a
    # VM where the helper slept: past GOMP_SPINCOUNT, or under OMP_WAIT_POLICY=PASSIVE, engine/platform/openmp.py).
    # Instead each core forwards its own shard of the sequences with one thread: no wake-ups, no barriers, one
    # hand-off per step. Each core reads every weight, which costs little at these batch sizes (SPLIT_MIN_ROWS).
    # The tokens are the same as one forward's up to GEMM summation order (as any change of batch size).

    def _num_shards(self, inp: ModelInput) -> int:
        meta = inp.meta
        # (A speculative step's rows of one sequence read each other's K/V: they run as one forward.)
        if not self._split or meta.num_prefill_tokens or inp.prompt_rows or self._drafting:
            return 1
        return min(self._threads, SPLIT_MAX_SHARDS, meta.num_decode_tokens // self._split_min_rows)

    def _greedy_stats(self, hidden: torch.Tensor, out: Callable[[], Optional[torch.Tensor]]) -> GreedyStats:
        """The rows' GreedyStats from the head without logits (LlamaForCausalLM.compute_greedy), else from the
        logits, written into out() (a kept buffer, or None)."""
        compute_greedy = getattr(self.model, "compute_greedy", None)
        stats = compute_greedy(hidden) if compute_greedy is not None else None
        if stats is None:
            return GreedyStats.of(self.model.compute_logits(hidden, out()))
        return GreedyStats(*stats)

    def _split_decode(self, inp: ModelInput, kv_caches: list[KVCache], shards: int,
                      greedy: bool = False) -> torch.Tensor | GreedyStats:
        n = inp.meta.num_decode_tokens
        bounds = [n * i // shards for i in range(shards + 1)]
        threads = [self._threads // shards + (1 if i < self._threads % shards else 0) for i in range(shards)]
        if self._shard_pool is None:  # created from the step thread: the workers inherit its scheduling priority
            self._shard_pool = ThreadPoolExecutor(max_workers=SPLIT_MAX_SHARDS - 1, thread_name_prefix="decode-shard")
        # Each shard's head writes its rows of one buffer (no concatenation of the logits): unless greedy, and then
        # only where the head has no stats of its own (compute_greedy).
        serves = getattr(self.model, "serves_greedy", None)
        stats = greedy and serves is not None and all(
            serves(bounds[i + 1] - bounds[i], self._dtype, self.device) for i in range(shards))
        out = None if stats else self._logits_out(n)
        outs = [None if out is None else out[bounds[i]:bounds[i + 1]] for i in range(shards)]
        futures = [
            self._shard_pool.submit(self._forward_shard, inp, bounds[i], bounds[i + 1], kv_caches, threads[i],
                                    outs[i], greedy)
            for i in range(1, shards)
        ]
        first = self._forward_shard(inp, bounds[0], bounds[1], kv_caches, threads[0], outs[0], greedy)
        parts = [first] + [f.result() for f in futures]
        if greedy:
            return GreedyStats(*(torch.cat([p[j] for p in parts]) for j in range(3)))
        if out is not None and all(p.data_ptr() == o.data_ptr() for p, o in zip(parts, outs)):
            return out
        return torch.cat(parts)  # [num_rows, vocab], rows in order

    @torch.inference_mode()  # thread-local: the pool's threads need their own
    def _forward_shard(self, inp: ModelInput, a: int, b: int, kv_caches: list[KVCache], threads: int,
                       out: Optional[torch.Tensor] = None, greedy: bool = False) -> torch.Tensor | GreedyStats:
        meta = AttentionMetadata(
            slot_mapping=inp.meta.slot_mapping[a:b],
            decode_block_tables=inp.meta.decode_block_tables[a:b],
            decode_context_lens=inp.meta.decode_context_lens[a:b],
        )
        with ops.thread_omp_threads(threads):
            hidden = self.model(inp.input_ids[a:b], inp.positions[a:b], kv_caches, meta)
            if greedy:
                return self._greedy_stats(hidden, lambda: out)
            return self.model.compute_logits(hidden, out)  # decode rows: logits_indices is arange(num_rows)

    def prepare(self, out) -> Optional[ModelInput]:
        """The step's input: the steady decode's batch moved one token on, or built from the scheduled groups."""
        steady, batch = getattr(out, "steady", None), self.batch
        decode_only = steady is not None and len(out.scheduled) == len(steady.scheduled)
        if (decode_only and batch is not None and batch.version == steady.version
                and batch.steps + 1 == steady.steps and self._input_device.type == "cpu"):
            return batch.advance(out)
        inp = self._build(out)
        # A decode-only step of a steady decode starts a batch that its next steps advance.
        self.batch = (DecodeBatch(steady.version, steady.steps, inp, self.block_size)
                      if decode_only and inp is not None and self._input_device.type == "cpu" else None)
        return inp

    def _build(self, out) -> Optional[ModelInput]:
        """Flatten the scheduled sequences: the prefill groups' spans first, then one token per decode row."""
        prefill_rows: list[_Row] = []
        decode_rows: list[_Row] = []
        num_sampled = 0
        drafts = getattr(out, "drafts", None) or {}
        for sg in out.scheduled:
            for seq in sg.group.seqs:
                if seq.status is SequenceStatus.RUNNING:
                    row = _Row(seq, sg.group, seq.num_computed_tokens, sg.span_end(seq),
                               num_sampled if sg.do_sample else None)
                    # A decode with proposals gets one logits row per position (engine/spec_decode/).
                    num_sampled += sg.do_sample * (1 + len(drafts.get(seq.seq_id, ())))
                    (prefill_rows if sg.is_prefill else decode_rows).append(row)
        if not prefill_rows and not decode_rows:
            return None
        bs = self.block_size
        tables = out.block_tables

        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[PrefillSpan] = []
        logits_indices = [0] * num_sampled  # each sampled row's last token, in the scheduler's row order
        prompt_rows: dict[str, tuple[int, int]] = {}
        for seq, group, start, end, logits_row in prefill_rows:
            table = tables[seq.seq_id]
            offset = len(tokens)
            tokens += seq.all_token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cached_table = None
            if start > 0:  # the prefix cache holds tokens [0, start): attention reads them back from the blocks
                cached_table = torch.tensor(table[: (end + bs - 1) // bs], dtype=torch.int32, device=self._input_device)
            spans.append(PrefillSpan(offset, len(tokens), end, cached_table))
            if logits_row is not None:
                logits_indices[logits_row] = len(tokens) - 1
            num_prompt_positions = logits_positions(group, seq, start, end)
            if num_prompt_positions:
                prompt_rows[group.request_id] = (offset, offset + num_prompt_positions)
        num_prefill_tokens = len(tokens)

        decode_tables, decode_lens = [], []
        for seq, _, _, end, logits_row in decode_rows:  # one token each: the last one, at position end - 1
            table = tables[seq.seq_id]
            # With proposals d1..dk: k more rows, each a decode of its own that attends over the K/V this forward
            # writes for the rows before it (every row's K/V is in the cache before any attention reads it).
            for i, token in enumerate([seq.get_last_token_id(), *drafts.get(seq.seq_id, ())]):
                position = end - 1 + i
                logits_indices[logits_row + i] = len(tokens)
                tokens.append(token)
                positions.append(position)
                slots.append(table[position // bs] * bs + position % bs)
                decode_tables.append(table)
                decode_lens.append(position + 1)

        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            prefills=spans,
            num_prefill_tokens=num_prefill_tokens,
        )
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_tables = self._tensor([t + [0] * (width - len(t)) for t in decode_tables], torch.int32)
            meta.decode_context_lens = self._tensor(decode_lens, torch.int32)
        return ModelInput(
            input_ids=self._tensor(tokens, torch.int64),
            positions=self._tensor(positions, torch.int64),
            meta=meta,
            logits_indices=self._tensor(logits_indices, torch.int64),
            prompt_rows=prompt_rows,
        )

    def _prefill_batch(self, spans: list[PrefillSpan]) -> Optional[PrefillBatch]:
        """The step's spans for the engine's batched prefill kernel, on this device; None where it has none or a
        span reads a cached prefix (engine/model_executor/layers/attention.py then runs SDPA per sequence)."""
        if self.prefill_kernel is None or not spans or any(span.num_cached for span in spans):
            return None
        return PrefillBatch(self.prefill_kernel, self.prefill_kernel.prepare([s.end - s.start for s in spans],
                                                                             self.device))

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return t.to(self._input_device, non_blocking=True) if self._input_device.type != "cpu" else t

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward of max_num_batched_tokens prompt tokens over max_num_seqs sequences, no cache (CUDA sizing)."""
        total = self.config.max_num_batched_tokens or 2048
        num_seqs = max(1, min(self.config.max_num_seqs, total))
        lens = [total // num_seqs + (1 if i < total % num_seqs else 0) for i in range(num_seqs)]
        spans, offset = [], 0
        for n in lens:
            spans.append(PrefillSpan(offset, offset + n, n))
            offset += n
        # Single-token spans would be decodes; as a cache-less profile they are 1-token prefills, which is fine.
        meta = AttentionMetadata(
            slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=self.device),
            prefills=spans,
            num_prefill_tokens=total,
            prefill_batch=self._prefill_batch(spans),
        )
        vocab = self.model.args.vocab_size
        input_ids = torch.randint(0, vocab, (total,), device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(input_ids, positions, None, meta)
        last = torch.tensor([s.end - 1 for s in spans], device=self.device)
        self.model.compute_logits(hidden[last])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
