"""The engine's speculative step: propose for the step's decodes, verify in the step's one forward, accept.

Use (LLMEngine._step, after schedule() and the cache moves):

    if spec.plan(out, scheduler):          # out.drafts filled, their slots taken
        return spec.run(engine, out, outputs)

A sequence at length L (its last token at position L - 1 not yet computed) with proposals d1..dk runs k + 1
decode rows: tokens [t, d1..dk] at positions L-1..L+k-1, row i attending over L + i tokens. Row i's logits
give the token after d_i; each position is sampled exactly as a plain step would sample it (the same sampler, on
the sequence as it stands with the accepted tokens appended), and the tokens go on while the sampled one equals
the proposal. Greedy: the same tokens as without speculation. Sampling: a proposal is one token (a point mass), and
"draw x ~ p, keep it, go on iff x == d" is the rejection sampler for a point mass (accept d with probability p(d),
else draw from p without d): the output distribution is the target's (tests/e2e/test_spec_decode.py checks it).
Stops, max_tokens, grammars, logprobs and penalties see every token as it is appended,
so nothing overshoots. Afterwards the sequence's computed length is L + accepted and whole blocks past its new
length go back to the pool.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from engine import ops
from engine.core.scheduler import BlockActions, SchedulerOutput
from engine.faults import StepError
from engine.sample.prompt_logprobs import add_prompt_logprobs
from engine.sample.sampler import Sample, _simple_group
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramIndex, ngram_propose
from engine.spec_decode.policy import PRIOR_ALPHA, Acceptance, DraftCost, Overhead, Pool, StepCost, choose

GC_EVERY = 256  # steps between sweeps of the records of sequences no longer scheduled


class SpecDecoder:
    """Proposals, the cost model and the counters of one engine."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.draft = draft  # engine/spec_decode/draft.py DraftProposer, for method "draft_model"
        self.cost = StepCost()  # plain decode-only steps
        self.overhead = Overhead()  # what a speculating step costs beyond its rows (the draft's forwards aside)
        self.pool = Pool() if draft is not None else None  # the draft's acceptance: each new sequence's prior
        self.draft_cost = DraftCost() if draft is not None else None
        self._draft_seconds = 0.0  # this step's draft forwards
        self.records: dict[int, Acceptance] = {}
        self.steps = 0
        # vLLM's counters: sequences that speculated (a step each), tokens proposed, tokens accepted.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self._rows: Optional[int] = None  # this step's rows, for the cost model (None: not a decode-only step)
        self._speculated = False  # this step verifies proposals
        self._pending: Optional[tuple[int, float]] = None  # the last step's (rows, seconds) when it speculated
        # Tests: every sequence with a proposal speculates, whatever the cost model says (the verification path
        # runs on whatever machine the suite does).
        self.always = False

    # -- before the forward ------------------------------------------------------------

    def plan(self, out: SchedulerOutput, scheduler) -> bool:
        """Choose who speculates this step, propose, take the slots; True when out.drafts is not empty."""
        self.steps += 1
        if self.steps % GC_EVERY == 0:
            self.records = {sid: r for sid, r in self.records.items() if r.last_step > self.steps - GC_EVERY}
            if self.draft is not None:
                self.draft.forget(set(self.records))
        prefill_tokens = sum(sg.num_tokens for sg in out.scheduled if sg.is_prefill)
        rows = out.num_batched_tokens
        self._rows = rows if not prefill_tokens else None
        self._speculated = False
        self._draft_seconds = 0.0
        prior = self.pool.alpha() if self.pool is not None else PRIOR_ALPHA
        candidates: list[tuple[float, int, Sequence, Acceptance]] = []  # (alpha, most proposals, ...)
        for sg in out.scheduled:
            group = sg.group
            if sg.is_prefill or group.sampling_params.use_beam_search:
                continue
            for seq in group.seqs:
                if seq.status is SequenceStatus.RUNNING:
                    record = self._record(seq)
                    limit = self._limit(seq, group)
                    if limit > 0:
                        candidates.append((record.alpha(prior), limit, seq, record))
        if not candidates:
            return False
        # Who could pay at best (each with all its proposals): only they propose. A compute-bound batch stops
        # here, before any lookup or draft forward is spent on it.
        candidates.sort(key=lambda c: -c[0])
        count = len(candidates) if self.always else choose(rows, [(a, k) for a, k, _, _ in candidates], self.cost,
                                                                     self.overhead.seconds(), self.draft_cost)
        for _, _, _, record in candidates[count:]:
            record.idle()
        chosen = candidates[:count]
        if not chosen:
            self.overhead.idle()
            if self.pool is not None:
                self.pool.idle()
            return False
        if self.draft is not None:  # the draft model proposes for all of them at once, one batch a position
            started = time.perf_counter()
            proposals = self.draft.propose([(seq, k) for _, k, seq, _ in chosen])
            self._draft_seconds = time.perf_counter() - started
            self.draft_cost.observe(len(chosen), self._draft_seconds)
        else:
            proposals = [self._ngram(seq, record, k) for _, k, seq, record in chosen]
        # With the proposals' real lengths (a lookup may find fewer than k, or none), choose again (the draft's
        # forwards are spent by now: they no longer count).
        found = [(a, len(p), seq, record, p) for (a, _, seq, record), p in zip(chosen, proposals) if p]
        count = len(found) if self.always else choose(rows, [(a, k) for a, k, *_ in found], self.cost,
                                                                 self.overhead.seconds())
        for _, _, _, record, _ in found[count:]:
            record.idle()
        chosen = [(a, k, seq, None, record, p) for a, k, seq, record, p in found[:count]]
        bm = scheduler.block_manager
        for _, _, seq, _, record, proposal in chosen:
            if seq.grammar is not None:
                proposal = _grammar_prefix(seq, proposal)
            if proposal and bm.grow_for_draft(seq, seq.get_len() + len(proposal)):
                out.drafts[seq.seq_id] = proposal
        if self.draft is not None:  # proposed for and not verified after all: the draft's K/V goes back to t
            for _, _, seq, _ in candidates[: len(proposals)]:
                if seq.seq_id not in out.drafts:
                    self.draft.accepted(seq, 0)
        if not out.drafts:
            return False
        # The steady decode moves every row one token a step: this step moves some by more.
        scheduler.drop_steady()
        out.steady, out.steady_grown = None, []
        if self._rows is not None:
            self._rows += sum(len(p) for p in out.drafts.values())
        self._speculated = True
        return True

    def _ngram(self, seq: Sequence, record: Acceptance, k: int) -> list[int]:
        if record.index is None:
            record.index = NgramIndex()
        c = self.config
        return ngram_propose(record.index.view(seq.get_len(), seq), k, c.prompt_lookup_max, c.prompt_lookup_min)

    def _record(self, seq: Sequence) -> Acceptance:
        record = self.records.get(seq.seq_id)
        if record is None:
            record = self.records[seq.seq_id] = Acceptance()
        record.last_step = self.steps
        return record

    def _limit(self, seq: Sequence, group: SequenceGroup) -> int:
        """The most proposals worth verifying: a step adds at most k + 1 tokens, and max_tokens and the context
        must have room for all of them (proposals past the end would be computed for nothing)."""
        params = group.sampling_params
        left = self.max_model_len - seq.get_len()
        if params.max_tokens is not None:
            left = min(left, params.max_tokens - seq.get_output_len())
        return min(self.k, left - 1)

    # -- the step ---------------------------------------------------------------------

    def end_step(self, seconds: float) -> None:
        """The step's wall time, for the cost model (decode-only steps; plan() ran in it): a plain step's goes to
        the line, a speculating step's excess over the line to the overhead, with what the plain step after it
        took beyond the line (it rebuilds the steady decode)."""
        rows, self._rows = self._rows, None
        speculated, self._speculated = self._speculated, False
        seconds -= self._draft_seconds  # (in draft_cost: the overhead is what verifying costs beyond its rows)
        self._draft_seconds = 0.0
        if self._pending is not None:
            spec_rows, spec_seconds = self._pending
            self._pending = None
            spec_plain = self.cost.seconds(spec_rows)
            after = self.cost.seconds(rows) if rows is not None and not speculated else None
            if spec_plain is not None:
                excess = spec_seconds - spec_plain + (max(seconds - after, 0.0) if after is not None else 0.0)
                self.overhead.observe(excess, spec_plain)
            if after is not None:
                return  # (not a plain step's sample: it paid for the one before)
        if rows is None:
            return
        if speculated:
            self._pending = (rows, seconds)
        else:
            self.cost.observe(rows, seconds)

    def run(self, engine, out: SchedulerOutput, outputs: list) -> list:
        """The rest of a speculative step (LLMEngine._step's general path, k + 1 positions for some rows)."""
        sch = engine.scheduler
        scheduled = [sg.group for sg in out.scheduled]
        engine._leave_batch()
        rows = [(sg.group, sg.group.get_seqs(SequenceStatus.RUNNING)) for sg in out.scheduled if sg.do_sample]
        engine._prompt_tokens_total += sum(sg.num_tokens for sg in out.scheduled if sg.is_prefill)
        logits, prompt_logits = engine.model_runner.execute(out, engine.cache_engine.device_cache,
                                                            at=lambda stage: engine._at(stage, scheduled))
        add_prompt_logprobs(out, prompt_logits)
        sch.update_computed(out)
        engine._at("sampler", scheduled)
        drafts = out.drafts
        plain, plain_rows, spec = [], [], []
        row = 0
        for group, seqs in rows:
            if any(seq.seq_id in drafts for seq in seqs):
                spec.append((group, seqs, row))
            else:
                plain.append((group, seqs))
                plain_rows += range(row, row + len(seqs))
            row += sum(1 + len(drafts.get(seq.seq_id, ())) for seq in seqs)
        samples = engine.sampler(logits[torch.tensor(plain_rows, dtype=torch.long)], plain) if plain else []
        stats = None
        if any(_simple_group(g, s) and g.sampling_params.greedy for g, s, _ in spec):
            stats = ops.argmax_logsumexp(logits)  # every row's argmax and logsumexp, once
            stats = (stats[0].tolist(), (logits.gather(1, stats[0].unsqueeze(1)).squeeze(1) - stats[1]).tolist())
        num_tokens = sum(len(s) for s in samples)
        failed: list[tuple[SequenceGroup, str, Exception]] = []
        for (group, _), group_samples in zip(plain, samples):
            try:
                engine._at("output_processor", [group])
                sch.apply(engine.output_processor.process(group, group_samples,
                                                          at=lambda stage: engine._at(stage, [group])))
            except Exception as exc:  # this request's tokens or text: the others of the step go on
                failed.append((group, engine._stage, exc))
        for group, seqs, row in spec:
            try:
                engine._at("output_processor", [group])
                fast = stats if _simple_group(group, seqs) and group.sampling_params.greedy else None
                for seq in seqs:
                    num_tokens += self._verify(engine, group, seq, drafts.get(seq.seq_id, []), logits, row, fast)
                    row += 1 + len(drafts.get(seq.seq_id, ()))
            except Exception as exc:
                failed.append((group, engine._stage, exc))
        engine._generation_tokens_total += num_tokens
        now = time.monotonic()
        engine._token_times(rows, None, now)
        bad = {id(g) for g, _, _ in failed}
        for group, _ in rows:
            if group.is_finished():
                group.metrics.finished_time = now
            if id(group) not in bad and engine._due(group):
                outputs.append(engine._to_output(group))
        sch.free_finished_seq_groups()
        if failed:
            _, stage, exc = failed[0]
            raise StepError(stage, exc, engine._end([g for g, _, _ in failed]), outputs) from exc
        return outputs

    def _verify(self, engine, group: SequenceGroup, seq: Sequence, proposal: list[int], logits: torch.Tensor,
                row: int, fast: Optional[tuple[list[int], list[float]]]) -> int:
        """Sample the sequence's positions in order while they agree with the proposal; returns tokens appended."""
        start_len = seq.get_len()
        accepted = appended = 0
        for i in range(len(proposal) + 1):
            r = row + i
            if fast is not None:
                token = fast[0][r]
                sample = Sample(seq.seq_id, token, {token: fast[1][r]})
            else:
                sample = engine.sampler(logits[r:r + 1], [(group, [seq])])[0][0]
            appended += 1
            if _append(engine, group, seq, sample):
                break
            if i == len(proposal) or sample.token_id != proposal[i]:
                break
            accepted += 1
        if proposal:
            self.num_drafts += 1
            self.num_draft_tokens += len(proposal)
            self.num_accepted_tokens += accepted
            self.records[seq.seq_id].record(len(proposal), accepted)
            if self.pool is not None:
                self.pool.record(len(proposal), accepted)
        if not seq.is_finished():
            bm = engine.scheduler.block_manager
            seq.num_computed_tokens = start_len + accepted  # K/V of t, d1..d_accepted; the last token's not yet
            bm.truncate(seq, seq.get_len())
            if accepted:
                bm.mark_blocks_as_computed(group)
        if self.draft is not None:
            self.draft.accepted(seq, accepted)
        return appended


def _append(engine, group: SequenceGroup, seq: Sequence, sample: Sample) -> bool:
    """One token onto one sequence of the group, as OutputProcessor.process does it; True when it finished
    (its blocks then go back)."""
    proc = engine.output_processor
    params = group.sampling_params
    if group.metrics.first_token_time is None:
        group.metrics.first_token_time = time.monotonic()
    seq.append_token(sample.token_id, sample.logprobs)
    decode = proc.detokenize_all or _reads_text(params)
    new_text = proc.detokenizer.decode_next(seq, params.skip_special_tokens) if decode else ""
    if seq.refused_token is not None:
        proc._end_refused(group, seq)
    else:
        proc._check_stop(seq, params, len(new_text))
    if seq.is_finished():
        engine.scheduler.apply(BlockActions(frees=[seq]))
        return True
    return False


def _reads_text(params) -> bool:
    from engine.detokenizer import engine_reads_text

    return engine_reads_text(params)


def _grammar_prefix(seq: Sequence, proposal: list[int]) -> list[int]:
    """The proposal up to the first token the sequence's grammar refuses there (it could never be accepted)."""
    state = seq.grammar.fork()
    for i, token in enumerate(proposal):
        if state.is_terminated() or not state.accept(token):
            return proposal[:i]
    return proposal
