"""LLMEngine: one step = schedule -> cache moves -> forward -> sample -> outputs."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterable, Optional, Union

from engine import ops
from engine.worker.cache_engine import CacheEngine
from engine.config import EngineConfig
from engine.distributed.group import TPGroup, torchrun_env
from engine.faults import ADMISSION, STAGES, FaultInjector, StepError, block_problems
from engine.model_executor.loader import generation_stop_ids, load_hf_config, resolve_device
from engine.model_executor.models.llama import ModelArgs
from engine.output_processor import OutputProcessor, RowStops
from engine.sample.prompt_logprobs import add_prompt_logprobs
from engine.metrics import INTER_TOKEN_LATENCY_BUCKETS, ITERATION_TOKENS_BUCKETS, EngineStats, Tally
from engine.sample.sampler import BatchParams, RowSamples, Sampler
from engine.sampling_params import SamplingParams, bad_words_token_ids
from engine.spec_decode import build_spec_decoder
from engine.core.scheduler import Scheduler
from engine.sequence import RequestOutput, Sequence, SequenceGroup, SequenceStatus
from engine.structured_output.grammars import StructuredOutputs
from engine.worker.tp_workers import TensorParallelError, TPWorkers
from engine.worker.rank_state import RankState

logger = logging.getLogger(__name__)


class _StepBatch:
    """What the engine keeps for the steps of one steady decode: its rows by group, their sampling parameters and
    stop data as arrays (built at its first decode-only step, not per step)."""

    def __init__(self, version: int, scheduled, eos_token_id: Optional[int], max_model_len: int) -> None:
        self.version = version
        self.rows = [(sg.group, sg.group.get_seqs(SequenceStatus.RUNNING)) for sg in scheduled]
        self.params = BatchParams(self.rows)
        self.stops = RowStops(self.rows, eos_token_id, max_model_len)
        self.num_seqs = sum(len(seqs) for _, seqs in self.rows)
        # When its last step drew tokens (every row drew one); its groups' last_token_time lags until it is left.
        self.last_token_time: Optional[float] = None

    def leave(self) -> None:
        """The engine steps without it from now on: its groups take their last token time back."""
        if self.last_token_time is not None:
            for group, _ in self.rows:
                group.last_token_time = self.last_token_time


class LLMEngine:
    """The synchronous engine: add requests, call step() until they finish."""

    def __init__(self, config: EngineConfig, *, detokenize_all: bool = True) -> None:
        """detokenize_all False: an engine core process, whose API server decodes the text of the requests the
        engine does not read itself (engine/core_proc.py OutputAssembler); kept across reset()."""
        self.detokenize_all = detokenize_all
        # The engine resolves its own copy (block size, max_model_len, ...): the caller's config may build others.
        self.config = config = dataclasses.replace(config)
        # Build/load the kernels before the weights: a CUDA engine without its compiled kernels refuses to
        # start (ops_loader.require_backend), and loading imports torch.utils.cpp_extension (setuptools,
        # ~0.3 s holding the GIL), which in the first step would stall a server's event loop.
        device = resolve_device(config)
        config.resolve_block_size(device.type)
        ops.require_backend(device)
        # Tensor parallelism: the other ranks load their shards alongside this one (engine/worker/tp_workers.py).
        self.workers: Optional[TPWorkers] = None
        tp = TPGroup.single()
        if config.tensor_parallel_size > 1 or torchrun_env() is not None:
            ModelArgs.from_hf(load_hf_config(config)).check_tensor_parallel(config.tensor_parallel_size)
            self.workers, tp = TPWorkers.start(config, device)
        try:
            rank = RankState.build(config, tp)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        loaded, self.model_runner, self.cache_engine = rank.loaded, rank.runner, rank.cache_engine
        self.model, self.tokenizer, self.hf_config = loaded.model, loaded.tokenizer, loaded.hf_config
        self.device, self.dtype = loaded.device, loaded.dtype
        self.model_runner.workers = self.workers
        self.model_runner.reuse_logits = True  # a step's logits are read within the step
        self.model_runner.capture_graphs(self.cache_engine.device_cache)  # CUDA, one rank, not --enforce-eager
        num_device_blocks, num_cpu_blocks = self.cache_engine.num_device_blocks, self.cache_engine.num_cpu_blocks
        self.eos_token_id: Optional[int] = self.tokenizer.eos_token_id
        # The model's other end-of-reply tokens (Gemma's <end_of_turn>): every request stops at them, as in vLLM.
        self.extra_stop_ids = generation_stop_ids(config.model, self.tokenizer)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.seq_counter = itertools.count()
        self._structured: Optional[StructuredOutputs] = None
        self._structured_lock = threading.Lock()
        self._build_scheduling(num_device_blocks, num_cpu_blocks)
        self.spec = build_spec_decoder(config, self)  # speculative decoding (engine/spec_decode/); None: off
        self.fault_injector: Optional[FaultInjector] = None  # tests: called at each stage and admission (faults.py)
        # What step() reports of a group: None, its RequestOutput; an engine core process sets its own (its wire's
        # delta built straight from the sequences: engine/core_proc.py OutputDeltas.build).
        self.output_builder: Optional[Callable[[SequenceGroup], Any]] = None
        self._stage = STAGES[0]
        self._step_groups: Optional[list[SequenceGroup]] = None
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._preempted_recompute = 0
        self._preempted_swap = 0
        self._iteration_tokens = Tally(ITERATION_TOKENS_BUCKETS)  # tokens computed a step: prompt + generated
        self._inter_token_latency = Tally(INTER_TOKEN_LATENCY_BUCKETS)

    @property
    def on_fatal(self) -> Optional[Callable[[BaseException], None]]:
        """Called (from a watcher thread) when a tensor-parallel rank dies between steps."""
        return self.workers.on_death if self.workers is not None else None

    @on_fatal.setter
    def on_fatal(self, callback: Optional[Callable[[BaseException], None]]) -> None:
        if self.workers is not None:
            self.workers.on_death = callback

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the other tensor-parallel ranks (graceful: no step is running); nothing to do on one rank."""
        if self.workers is not None:
            self.workers.shutdown(graceful)

    def _build_scheduling(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        """The per-request state: queues and block tables, sampler generators, detokenizer."""
        # The model's window (every layer's) lets the block manager release blocks the attention no longer reads.
        self.scheduler = Scheduler(self.config, num_device_blocks, num_cpu_blocks, sliding_window=self.model.kv_window)
        self.sampler = Sampler(eos_token_id=self.eos_token_id, seed=self.config.seed)
        self.output_processor = OutputProcessor(self.tokenizer, self.config.max_model_len, self.eos_token_id,
                                                self.seq_counter, self.detokenize_all)
        self._batch: Optional[_StepBatch] = None

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
        grammar: Optional[Any] = None,
    ) -> None:
        """Queue one request. ValueError for an empty prompt or token ids outside the vocabulary.

        `params` is read, never changed (one object may serve many requests); max_tokens None generates until
        the context (max_model_len) is full. With --scheduling-policy priority a lower `priority` runs first.
        `grammar`: params.guided compiled already (AsyncLLMEngine compiles in its grammar thread); None: the
        spec is compiled here, or taken from the cache. With params.final_only step() reports the request only
        when it has finished.
        """
        if self.fault_injector is not None:
            self.fault_injector(ADMISSION, [request_id])
        params = params if params is not None else SamplingParams()
        extra = [t for t in self.extra_stop_ids if t not in params.stop_token_ids] if not params.ignore_eos else []
        if extra:  # (a copy: params is read, never changed)
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        if params.bad_words and params.bad_words_token_ids is None:  # vLLM's words, tokenized here (a copy)
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer,
                                                                                         params.bad_words))
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt: either a prompt or prompt_token_ids is required.")
            prompt_token_ids = self.tokenize(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt: the prompt is empty.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is out of vocabulary (size {self.vocab_size}).")
        bad = [t for t in params.logprob_token_ids or () if t >= self.vocab_size]  # (they index the logits)
        if bad:
            raise ValueError(f"logprob_token_ids: token id {bad[0]} is out of vocabulary (size {self.vocab_size}).")
        seq = Sequence(next(self.seq_counter), list(prompt_token_ids))
        if params.guided is not None:
            compiled = grammar if grammar is not None else self.structured.compile(params.guided)
            seq.grammar = self.structured.new_state(compiled, params.guided_after)
        group = SequenceGroup(request_id, [seq], params, arrival_time, priority, prompt)
        self.scheduler.add_seq_group(group)

    @property
    def structured(self) -> StructuredOutputs:
        """The grammar compiler for this tokenizer, made on first use (a server that never sees a constraint
        never loads xgrammar). Thread-safe: the server compiles off the event loop before add_request."""
        if self._structured is None:
            with self._structured_lock:
                if self._structured is None:
                    self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_id,
                                                         int(self.config.grammar_cache_mb * 2**20))
        return self._structured

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> list[SequenceGroup]:
        """End requests in whichever queue they are; their blocks go back to the pool."""
        return self.scheduler.abort_seq_group(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    # -- the step -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward over the batch, sample, and report every touched request.

        A stage that raises ends the requests of this step (a per-request stage: only that request), frees
        their blocks and raises StepError naming them; waiting and swapped requests go on in the next step.
        """
        self._stage, self._step_groups = STAGES[0], None
        outputs: list[RequestOutput] = []
        counted = self._prompt_tokens_total + self._generation_tokens_total
        started = time.perf_counter()
        try:
            return self._step(outputs)
        except (StepError, TensorParallelError):  # the latter: the ranks are out of step, the engine must stop
            raise
        except Exception as exc:
            # Before schedule() returned no request belonged to the step: none is ended (the caller checks the
            # block invariants, and resets when they fail or the fault recurs).
            raise StepError(self._stage, exc, self._end(self._step_groups or []), outputs) from exc
        finally:
            computed = self._prompt_tokens_total + self._generation_tokens_total - counted
            if computed:  # (a step that ran no forward computed none)
                self._iteration_tokens.observe(computed)
            if self.spec is not None:
                self.spec.end_step(time.perf_counter() - started)

    def _step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        sch = self.scheduler
        self._at("schedule", itertools.chain(sch.waiting, sch.running, sch.swapped))
        out = self.scheduler.schedule()
        self._preempted_recompute += out.num_preempted_recompute
        self._preempted_swap += out.num_preempted_swap
        now = time.monotonic()
        for group in out.ignored:
            group.metrics.finished_time = now
            outputs.append(self._to_output(group))
        scheduled = [sg.group for sg in out.scheduled]
        # Until the swaps are done, a group swapped out in this step has no whole copy of its K/V anywhere.
        self._step_groups = scheduled + self._swapping_out(out)
        self._at("cache_ops", scheduled)
        self.cache_engine.apply(out)
        self._step_groups = scheduled
        if not out.scheduled:
            if self.workers is not None and (out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy):
                self.workers.send_step(out, None)  # the other ranks' caches make the same moves
            return outputs
        if self.spec is not None and self.spec.plan(out, self.scheduler):  # some decodes verify proposals
            return self.spec.run(self, out, outputs)

        batch = self._step_batch(out)
        if batch is not None:  # a decode-only step of a steady decode: its rows and parameters are kept
            rows = batch.rows
        else:  # a prompt chunk short of the prompt's end (chunked prefill) samples nothing and reports nothing yet
            rows = [(sg.group, sg.group.get_seqs(SequenceStatus.RUNNING)) for sg in out.scheduled if sg.do_sample]
            self._prompt_tokens_total += sum(sg.num_tokens for sg in out.scheduled if sg.is_prefill)
        # One pass when every row draws one plain token; the per-sample path otherwise (and under fault injection,
        # whose stages name requests one at a time, or a sampler stood in by a plain callable). A steady decode
        # whose rows are all plain greedy needs no logits: the head's argmax and logsumexp (GreedyStats) do.
        sample_rows = getattr(self.sampler, "sample_rows", None)
        fast_path = sample_rows is not None and self.fault_injector is None
        greedy = fast_path and batch is not None and batch.params.all_greedy
        logits, prompt_logits = self.model_runner.execute(out, self.cache_engine.device_cache,
                                                          at=lambda stage: self._at(stage, scheduled), greedy=greedy)
        add_prompt_logprobs(out, prompt_logits)
        self.scheduler.update_computed(out)
        self._at("sampler", scheduled)
        fast = sample_rows(logits, rows, batch.params if batch is not None else None) if fast_path else None
        if fast is not None:
            return self._process_rows(out, rows, fast, batch, outputs)
        self._leave_batch()  # (its stop data counts the fast path's steps)
        samples = self.sampler(logits, rows)
        # A request's first sampling with n > 1 draws its n tokens from one row; beam search keeps one a beam.
        self._generation_tokens_total += sum(len(seqs) if group.sampling_params.use_beam_search else len(drawn)
                                             for (group, seqs), drawn in zip(rows, samples))
        self._token_times(rows, None, time.monotonic())

        failed: list[tuple[SequenceGroup, str, Exception]] = []
        for (group, _), group_samples in zip(rows, samples):
            try:
                self._at("output_processor", [group])
                self.scheduler.apply(self.output_processor.process(group, group_samples,
                                                                   at=lambda stage: self._at(stage, [group])))
            except Exception as exc:  # this request's tokens or text: the others of the step go on
                failed.append((group, self._stage, exc))
                continue
            if group.is_finished():
                group.metrics.finished_time = time.monotonic()
            if self._due(group):
                outputs.append(self._to_output(group))
        self.scheduler.free_finished_seq_groups()
        if failed:
            _, stage, exc = failed[0]
            raise StepError(stage, exc, self._end([g for g, _, _ in failed]), outputs) from exc
        return outputs

    def _step_batch(self, out) -> Optional[_StepBatch]:
        """The kept rows of a decode-only step of the scheduler's steady decode (made at its first step)."""
        steady = out.steady
        if steady is None or len(out.scheduled) != len(steady.scheduled):
            self._leave_batch()
            return None
        if self._batch is None or self._batch.version != steady.version:
            self._leave_batch()
            self._batch = _StepBatch(steady.version, steady.scheduled, self.eos_token_id, self.config.max_model_len)
        return self._batch

    def _leave_batch(self) -> None:
        if self._batch is not None:
            self._batch.leave()
            self._batch = None

    def _token_times(self, rows, batch: Optional[_StepBatch], now: float) -> None:
        """Inter-token latency: for each sequence that drew a token, the time since its previous one (vLLM's ITL;
        a request's first token is its TTFT instead). A steady decode's rows all drew their last token in its step
        before: one value, counted once per sequence, with no loop over the rows."""
        if batch is not None and batch.last_token_time is not None:
            self._inter_token_latency.observe(now - batch.last_token_time, batch.num_seqs)
        else:
            for group, seqs in rows:
                if group.last_token_time is not None:
                    self._inter_token_latency.observe(now - group.last_token_time, len(seqs))
                group.last_token_time = now
        if batch is not None:
            batch.last_token_time = now

    def _process_rows(self, out, rows, samples: RowSamples, batch: Optional[_StepBatch],
                      outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs of a step whose every row drew one token: stop checks over the batch's arrays first."""
        sampled, sampled_logprobs = samples.token_ids, samples.logprobs
        if not sampled.is_cpu:  # on the host once: the stop checks, the outputs and the next step's input read them
            sampled, sampled_logprobs = sampled.cpu(), sampled_logprobs.cpu()
        sampled = sampled.numpy()
        self.model_runner.record_sampled(sampled)
        token_ids, logprobs = sampled.tolist(), sampled_logprobs.tolist()
        self._generation_tokens_total += len(token_ids)
        now = time.monotonic()
        self._token_times(rows, batch, now)
        stops = batch.stops if batch is not None else RowStops(rows, self.eos_token_id, self.config.max_model_len)
        self._stage = "output_processor"
        actions, finished, failed = self.output_processor.process_rows(rows, token_ids, logprobs,
                                                                       stops.flagged(sampled))
        self.scheduler.apply(actions)
        if finished:
            for group in finished:
                group.metrics.finished_time = now
        to_output = self.output_builder or self.output_processor.to_request_output
        if failed:
            bad = {id(group) for group, _ in failed}
            outputs += [to_output(group) for group, _ in rows if id(group) not in bad and self._due(group)]
        elif self.config.stream_interval == 1:
            outputs += [to_output(group) for group, _ in rows if not group.final_only or group.is_finished()]
        else:
            due = self._due
            outputs += [to_output(group) for group, _ in rows if due(group)]
        self.scheduler.free_finished_seq_groups(finished)
        if failed:
            exc = failed[0][1]
            raise StepError("output_processor", exc, self._end([g for g, _ in failed]), outputs) from exc
        return outputs

    def _to_output(self, group: SequenceGroup) -> Any:
        return (self.output_builder or self.output_processor.to_request_output)(group)

    def _due(self, group: SequenceGroup) -> bool:
        """Whether this step reports the group (it just drew tokens): a final_only group when it ended; any other
        always at stream_interval 1, else with its first tokens, every stream_interval steps and when it ended.
        What a skipped step made comes with the next output (a RequestOutput holds everything so far)."""
        if group.final_only:
            return group.is_finished()
        interval = self.config.stream_interval
        if interval == 1 or group.steps_unreported < 0 or group.is_finished():
            group.steps_unreported = 0
            return True
        group.steps_unreported += 1
        if group.steps_unreported >= interval:
            group.steps_unreported = 0
            return True
        return False

    def _at(self, stage: str, groups: Iterable[SequenceGroup]) -> None:
        self._stage = stage
        if self.fault_injector is not None:
            self.fault_injector(stage, [g.request_id for g in groups])

    def _swapping_out(self, out) -> list[SequenceGroup]:
        if not out.blocks_to_swap_out:
            return []
        targets = set(out.blocks_to_swap_out.values())
        tables = self.scheduler.block_manager.cpu_block_tables
        return [g for g in self.scheduler.swapped
                if any(b in targets for seq in g.seqs for b in tables.get(seq.seq_id, ()))]

    def _end(self, groups: list[SequenceGroup]) -> list[str]:
        """End the groups of a failed step wherever they are; every block they hold goes back."""
        ids = list(dict.fromkeys(g.request_id for g in groups))
        self.scheduler.abort_seq_group(ids)
        for group in groups:  # one already out of the queues (finished in this step) may still hold blocks
            for seq in group.seqs:
                self.scheduler.block_manager.free(seq)
        return ids

    def request_ids(self) -> set[str]:
        """The requests the engine holds, in any queue."""
        sch = self.scheduler
        return {g.request_id for g in itertools.chain(sch.waiting, sch.running, sch.swapped)}

    def block_problems(self) -> list[str]:
        """Broken block-manager invariants (empty: all hold); checked after a failed step."""
        return block_problems(self.scheduler)

    def reset(self) -> list[str]:
        """Drop every request and build the scheduler, block manager, KV cache and output processor anew
        (the model and tokenizer stay); returns the ids of the requests dropped."""
        dropped = sorted(self.request_ids())
        num_device_blocks, num_cpu_blocks = self.cache_engine.num_device_blocks, self.cache_engine.num_cpu_blocks
        self.cache_engine = None  # the old cache's memory goes back before the new one is allocated
        self.cache_engine = CacheEngine(self.config.block_size, self.hf_config, num_device_blocks, num_cpu_blocks,
                                        self.device, self.dtype, self.config.tensor_parallel_size)
        self.model_runner.capture_graphs(self.cache_engine.device_cache)
        self._build_scheduling(num_device_blocks, num_cpu_blocks)
        return dropped

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
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            spec_decode_num_drafts=self.spec.num_drafts if self.spec is not None else 0,
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens if self.spec is not None else 0,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens if self.spec is not None else 0,
            iteration_tokens=self._iteration_tokens.snapshot(),
            inter_token_latency=self._inter_token_latency.snapshot(),
        )

