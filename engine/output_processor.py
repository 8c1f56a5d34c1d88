"""After the sampler: fork, append, detokenize, stop; what to fork and free; and the RequestOutput of a group."""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Optional

import numpy as np

from engine.detokenizer import Detokenizer, engine_reads_text
from engine.sample.sampler import Sample
from engine.sampling_params import SamplingParams
from engine.core.scheduler import BlockActions
from engine.sequence import (
    FINISH_REASONS,
    UNFINISHED,
    CompletionOutput,
    RequestOutput,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)

logger = logging.getLogger(__name__)


def _no_fault(stage: str) -> None:
    pass


def beam_score(seq: Sequence, length_penalty: float) -> float:
    """HF's hypothesis score: cumulative logprob / generated length ** length_penalty.

    As in transformers >= 4.36, the length counts generated tokens only (the EOS
    included), not the prompt.
    """
    return seq.cumulative_logprob / (max(seq.get_output_len(), 1) ** length_penalty)


def _keep(group: SequenceGroup, kept: list[tuple[Sequence, Sequence]], actions: BlockActions) -> None:
    """Kept (child, parent) pairs: a new child joins the group and, if it goes on, shares its parent's blocks;
    a finished sequence gives its blocks back."""
    for seq, parent in kept:
        if seq is not parent:
            group.add(seq)
            if not seq.is_finished():
                actions.forks.append((parent, seq))
        elif seq.is_finished():
            actions.frees.append(seq)


class RowStops:
    """Per-row stop data of a batch as arrays, built when the batch changes (a steady decode keeps them, each
    step one token longer): the ids that end a row (EOS unless ignore_eos, stop_token_ids), its length cap
    (max_tokens, max_model_len), whether it has stop strings. A sampled id is checked against them over the
    whole batch at once; only the rows they flag go through the stop checks one by one."""

    def __init__(self, groups: list[tuple[SequenceGroup, list[Sequence]]], eos_token_id: Optional[int],
                 max_model_len: int) -> None:
        stop_ids, caps, lens, strings = [], [], [], []
        for group, seqs in groups:
            p = group.sampling_params
            ids = list(p.stop_token_ids) + ([eos_token_id] if eos_token_id is not None and not p.ignore_eos else [])
            for seq in seqs:
                prompt_len = len(seq.prompt_token_ids)
                stop_ids.append(ids)
                caps.append(max_model_len if p.max_tokens is None else min(max_model_len, prompt_len + p.max_tokens))
                lens.append(seq.get_len())
                strings.append(bool(p.stop))
        # [num_rows, width] (-1: none), [num_rows] where no row has more than one; None where no row has any.
        self.stop_ids: Optional[np.ndarray] = None
        width = max((len(ids) for ids in stop_ids), default=0)
        if width:
            self.stop_ids = np.full((len(stop_ids), width), -1, dtype=np.int64)
            for row, ids in enumerate(stop_ids):
                self.stop_ids[row, : len(ids)] = ids
            if width == 1:
                self.stop_ids = self.stop_ids[:, 0]
        # [num_rows] how many tokens each row takes before its cap; the rows move on together, one token a step,
        # so none reaches its cap before `self.first_cap` steps (the length check is skipped until then).
        self.left = np.array(caps, dtype=np.int64) - np.array(lens, dtype=np.int64)
        self.first_cap = int(self.left.min()) if len(self.left) else 0
        self.steps = 0
        self.string_rows = frozenset(i for i, has in enumerate(strings) if has)  # rows with stop strings

    def flagged(self, token_ids: np.ndarray) -> set[int]:  # token_ids: [num_rows]
        """The rows this step's tokens may end; every row is one token longer afterwards."""
        self.steps += 1
        rows = set(self.string_rows)
        stop_ids = self.stop_ids
        if stop_ids is not None:
            hits = stop_ids == token_ids if stop_ids.ndim == 1 else (stop_ids == token_ids[:, None]).any(axis=1)
            rows.update(hits.nonzero()[0].tolist())
        if self.steps >= self.first_cap:
            rows.update((self.left <= self.steps).nonzero()[0].tolist())
        return rows


class OutputProcessor:
    """Applies one step's samples to a group: forks, beams, stop checks; returns the blocks to fork and free."""

    def __init__(self, tokenizer, max_model_len: int, eos_token_id: Optional[int],
                 seq_counter: Iterator[int], detokenize_all: bool = True) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        # False in an engine core process: only the requests whose text the engine reads (engine_reads_text) are
        # decoded here; the API server decodes the others' token ids (engine/core_proc.py OutputAssembler).
        self.detokenize_all = detokenize_all
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.seq_counter = seq_counter

    # ---- one step ----------------------------------------------------------

    def process(self, group: SequenceGroup, samples: list[Sample],
                at: Callable[[str], None] = _no_fault) -> BlockActions:
        """Append the samples (forking where a sequence got several), check stops; the group's statuses and
        members change here, its blocks only when the engine applies the returned actions. `at("detokenizer")`
        is called as detokenization starts (engine/faults.py)."""
        actions = BlockActions()
        if group.metrics.first_token_time is None and samples:
            group.metrics.first_token_time = time.monotonic()
        params = group.sampling_params
        parents = group.get_seqs(SequenceStatus.RUNNING)
        # Hypotheses finished in earlier steps (beam search compares them with new ones).
        already_finished = [s for s in group.seqs if s.is_finished()]
        by_parent: dict[int, list[Sample]] = {p.seq_id: [] for p in parents}
        for sample in samples:
            by_parent[sample.parent_seq_id].append(sample)

        children: list[tuple[Sequence, Sequence]] = []  # (child, parent); child is parent when it continues
        for parent in parents:
            mine = by_parent[parent.seq_id]
            if not mine:
                # A beam no candidate extends: it is dropped for good.
                parent.status = SequenceStatus.FINISHED_ABORTED
                group.remove(parent.seq_id)
                actions.frees.append(parent)
                continue
            for sample in mine[:-1]:
                child = parent.fork(next(self.seq_counter))
                child.append_token(sample.token_id, sample.logprobs)
                children.append((child, parent))
            parent.append_token(mine[-1].token_id, mine[-1].logprobs)
            children.append((parent, parent))

        at("detokenizer")
        decode = self.detokenize_all or engine_reads_text(params)
        for seq, _ in children:
            new_text = self.detokenizer.decode_next(seq, params.skip_special_tokens) if decode else ""
            if seq.refused_token is not None:
                self._end_refused(group, seq)
                continue
            self._check_stop(seq, params, len(new_text))

        if params.use_beam_search:
            self._select_beams(group, children, already_finished, actions)
        else:
            _keep(group, children, actions)
        return actions

    @staticmethod
    def _end_refused(group: SequenceGroup, seq: Sequence) -> None:
        """The sequence's grammar refused its last token: it ends with an error (its request only; vLLM ends the
        request as FINISHED_ERROR too), never goes on unconstrained. If the grammar allows no token at all there,
        the request asked for text this vocabulary cannot spell (a regex with a character no token has): the
        client's error (FINISHED_IGNORED: a 400), not the server's (FINISHED_ERROR: a 503)."""
        if not seq.grammar.allows_any_token():
            seq.status = SequenceStatus.FINISHED_IGNORED
            group.error = (f"Structured output cannot go on: after {len(seq.output_token_ids) - 1} tokens the "
                           "request's grammar allows no token of this model's vocabulary (it asks for a character no "
                           "token spells).")
            return
        logger.error("request %s: the grammar refused the sampled token %d; ending the request", group.request_id,
                     seq.refused_token)
        seq.status = SequenceStatus.FINISHED_ERROR
        group.error = (f"Structured output failed: the sampled token {seq.refused_token} is not allowed by the "
                       "request's grammar at this point (an internal error; the output so far is not valid).")

    def process_rows(self, groups: list[tuple[SequenceGroup, list[Sequence]]], token_ids: list[int],
                     logprobs: list[float], flagged: set[int]) -> tuple[BlockActions, list[SequenceGroup],
                                                                         list[tuple[SequenceGroup, Exception]]]:
        """A step where every row drew one token (engine/sample/sampler.py's sample_rows): append each, detokenize, and
        run the stop checks on the `flagged` rows only (RowStops). Returns the blocks to free, the groups that
        finished, and the groups whose processing raised (their own error; the others go on)."""
        actions = BlockActions()
        finished: list[SequenceGroup] = []
        failed: list[tuple[SequenceGroup, Exception]] = []
        decode_next = self.detokenizer.decode_next
        detokenize_all = self.detokenize_all
        now = time.monotonic()
        row = 0
        for group, seqs in groups:
            first, row = row, row + len(seqs)
            params = group.sampling_params
            skip = params.skip_special_tokens
            keep_logprobs = params.logprobs is not None  # (nothing else reads them: a dict a token saved)
            decode = detokenize_all or engine_reads_text(params)
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            try:
                for r, seq in enumerate(seqs, first):
                    token, logprob = token_ids[r], logprobs[r]
                    seq.output_token_ids.append(token)
                    if keep_logprobs:
                        seq.output_logprobs.append({token: logprob})
                    seq.cumulative_logprob += logprob
                    new_text = decode_next(seq, skip) if decode else ""
                    if r in flagged:
                        self._check_stop(seq, params, len(new_text))
                        if seq.is_finished():
                            actions.frees.append(seq)
                            if group.is_finished():
                                finished.append(group)
            except Exception as exc:  # this request's tokens or text: the others of the step go on
                failed.append((group, exc))
        return actions, finished, failed

    def _check_stop(self, seq: Sequence, params: SamplingParams, new_char_count: int) -> None:
        """Stop conditions in vLLM's order: stop token / EOS, stop strings, then the length caps."""
        last = seq.output_token_ids[-1]
        if seq.grammar is not None and seq.grammar.is_terminated():
            # The grammar is complete and took its stop token (EOS): nothing else may follow, ignore_eos or not.
            if new_char_count and not params.include_stop_str_in_output:
                seq.output_text = seq.output_text[:-new_char_count]
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if seq.get_output_len() >= params.min_tokens:
            is_eos = not params.ignore_eos and last == self.eos_token_id
            if is_eos or last in params.stop_token_ids:
                # The stop token's own text is left out unless asked for.
                if new_char_count and not params.include_stop_str_in_output:
                    seq.output_text = seq.output_text[:-new_char_count]
                seq.stop_reason = None if is_eos else last
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if self._check_stop_strings(seq, params, new_char_count):
                return
        too_long = seq.get_len() >= self.max_model_len
        if too_long or (params.max_tokens is not None and seq.get_output_len() >= params.max_tokens):
            # The output ends here: emit any bytes held back for an unfinished character.
            self.detokenizer.flush(seq)
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    @staticmethod
    def _check_stop_strings(seq: Sequence, params: SamplingParams, new_char_count: int) -> bool:
        if not new_char_count:
            return False
        text = seq.output_text
        for stop in params.stop:
            # Only the new text, plus what a stop string could straddle, needs searching.
            index = text.find(stop, max(len(text) - new_char_count - len(stop) + 1, 0))
            if index == -1:
                continue
            end = index + len(stop) if params.include_stop_str_in_output else index
            seq.output_text = text[:end]
            seq.stop_reason = stop
            seq.status = SequenceStatus.FINISHED_STOPPED
            return True
        return False

    # ---- beam search -------------------------------------------------------

    def _select_beams(self, group: SequenceGroup, children: list[tuple[Sequence, Sequence]],
                      already_finished: list[Sequence], actions: BlockActions) -> None:
        """vLLM v0.2's beam step: keep the best beam_width finished and running hypotheses."""
        params = group.sampling_params
        width, lp = params.best_of, params.length_penalty
        score = lambda item: beam_score(item[0], lp)  # noqa: E731
        selected: list[tuple[Sequence, Sequence]] = []
        unselected: list[tuple[Sequence, Sequence]] = []

        existing = [(s, None, False) for s in already_finished]
        new_finished = [(s, p, True) for s, p in children if s.is_finished()]
        finished = sorted(existing + new_finished, key=score, reverse=True)
        for seq, parent, is_new in finished[:width]:
            if is_new:
                selected.append((seq, parent))
        for seq, parent, is_new in finished[width:]:
            if is_new:
                unselected.append((seq, parent))
            else:
                group.remove(seq.seq_id)

        running = sorted(((s, p) for s, p in children if not s.is_finished()), key=score, reverse=True)
        if not running:
            stop = True
        elif len(finished) < width:
            stop = False
        else:
            stop = self._can_stop(params, running[0][0], finished[width - 1][0])
        if stop:
            unselected.extend(running)
        else:
            selected.extend(running[:width])
            unselected.extend(running[width:])

        _keep(group, selected, actions)
        for seq, parent in unselected:
            if seq is parent:
                # A parent no longer wanted; its forked children (if any) hold their own blocks.
                group.remove(seq.seq_id)
                actions.frees.append(seq)

    def _can_stop(self, params: SamplingParams, best_running: Sequence, worst_finished: Sequence) -> bool:
        """HF's early_stopping: True stops once beam_width hypotheses exist; False / "never" compare scores."""
        if params.early_stopping is True:
            return True
        lp = params.length_penalty
        worst = beam_score(worst_finished, lp)
        if params.early_stopping == "never" and lp > 0.0:
            # A positive penalty favours length: the best running beam could still grow to the cap.
            longest = self.max_model_len - len(best_running.prompt_token_ids)
            if params.max_tokens is not None:
                longest = min(longest, params.max_tokens)
            best = best_running.cumulative_logprob / (max(longest, 1) ** lp)
        else:
            best = beam_score(best_running, lp)
        return worst >= best

    # ---- what the client sees ----------------------------------------------

    @staticmethod
    def to_request_output(group: SequenceGroup) -> RequestOutput:
        seqs, hold, keep_logprobs = reported(group)
        outputs = []
        for index, seq in enumerate(seqs):  # (positional arguments: this runs for every row of every step)
            text, status = seq.output_text, seq.status
            if hold and status in UNFINISHED:
                text = text[: max(len(text) - hold, 0)]
            outputs.append(CompletionOutput(index, text, seq.output_token_ids.copy(), seq.cumulative_logprob,
                                            seq.output_logprobs.copy() if keep_logprobs else None,
                                            FINISH_REASONS.get(status), seq.stop_reason))
        return RequestOutput(group.request_id, group.prompt, group.seqs[0].prompt_token_ids, group.prompt_logprobs,
                             outputs, group.is_finished(), group.error, group.metrics)


def reported(group: SequenceGroup) -> tuple[list[Sequence], int, bool]:
    """What a group's output reports: the sequences that are its choices, in order; how many characters of an
    unfinished one's text are held back; whether its choices carry logprobs. (to_request_output, and the engine
    core process's deltas, engine/core_proc.py OutputDeltas, which must report the same.)"""
    params = group.sampling_params
    if params.use_beam_search or params.best_of > params.n:
        # The n chosen ones are known only at the end (vLLM streams nothing before).
        if params.use_beam_search:
            key = lambda s: beam_score(s, params.length_penalty)  # noqa: E731
        else:
            key = lambda s: s.cumulative_logprob  # noqa: E731
        seqs = sorted(group.seqs, key=key, reverse=True)[: params.n] if group.is_finished() else []
    else:
        seqs = group.seqs if len(group.seqs) <= params.n else group.seqs[: params.n]
    # While a stop string could still be completing, hold its possible start
    # back, so streamed text never shows what truncation later removes.
    hold = max(len(s) for s in params.stop) - 1 if params.stop and not params.include_stop_str_in_output else 0
    return seqs, hold, params.logprobs is not None
