"""Turns one step's logits into tokens: which rows sample how (slots), seeded generators, the draw, logprobs.

The logit transforms themselves (penalties, bias, top-k/p, min-p, beam candidates) are engine/sample/logits_transforms.py.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from engine import ops
from engine.sample.logits_transforms import (adjust_logits, apply_min_p, apply_top_k_top_p, beam_candidates,
                                      sampling_probs)
from engine.sampling_params import SamplingParams
from engine.sequence import Logprobs, Sequence, SequenceGroup
from engine.structured_output.grammars import apply_grammar_masks

# Logprobs reported to the client (Sample.logprobs, cumulative_logprob; prompt logprobs too,
# engine/sample/prompt_logprobs.py) are log_softmax of the RAW model logits, before penalties, bias or temperature:
# that is what vLLM v0.2 and OpenAI report, and what HF's log_softmax parity check expects.
# Beam search ranks candidates with the log_softmax of the ADJUSTED logits
# (penalties, bias, min_tokens) so that e.g. a masked EOS can never be chosen.


class Sample(NamedTuple):
    parent_seq_id: int
    token_id: int
    logprobs: Logprobs  # the sampled token plus the top-`logprobs` alternatives


class RowSamples(NamedTuple):
    """One token per row (the common step): the ids and their logprobs (of the raw logits), in row order."""

    token_ids: torch.Tensor  # [num_rows] int64
    logprobs: torch.Tensor  # [num_rows] float32


class GreedyStats(NamedTuple):
    """Per row of a step's raw logits, all a greedy step without top logprobs needs: the first index of the largest
    logit, that logit, and the row's logsumexp. A CPU head computes them without writing the logits
    (LlamaForCausalLM.compute_greedy, engine/worker/model_runner.py); of() takes them from logits."""

    argmax: torch.Tensor  # [num_rows] int64
    max: torch.Tensor  # [num_rows] float32
    logsumexp: torch.Tensor  # [num_rows] float32

    @classmethod
    def of(cls, logits: torch.Tensor) -> "GreedyStats":
        argmax, lse = ops.argmax_logsumexp(logits)
        return cls(argmax, logits.gather(1, argmax.unsqueeze(1)).squeeze(1).float(), lse)


class BatchParams:
    """Per-row sampling parameters of a batch as tensors, built when the batch changes (a steady decode keeps
    them): which rows are greedy, the random rows' temperature, top-k / top-p, min-p, and whose generator each
    random row draws from. `simple` False: some row needs the per-sample path (beams, several samples from a
    row, top logprobs, penalties, biases, masks, min_tokens, a grammar)."""

    def __init__(self, groups: list[tuple[SequenceGroup, list[Sequence]]]) -> None:
        self.simple = all(_simple_group(group, seqs) for group, seqs in groups)
        self.all_greedy = self.simple and all(group.sampling_params.greedy for group, _ in groups)
        if not self.simple or self.all_greedy:
            return
        rows: list[int] = []
        params: list[SamplingParams] = []
        # Runs of random rows drawing from one generator: (first, end, the group whose seed it is or None).
        self.runs: list[tuple[int, int, Optional[SequenceGroup]]] = []
        row = 0
        for group, seqs in groups:
            p = group.sampling_params
            if not p.greedy:
                owner = group if p.seed is not None else None
                first = len(rows)
                rows += range(row, row + len(seqs))
                params += [p] * len(seqs)
                if self.runs and owner is None and self.runs[-1][2] is None and self.runs[-1][1] == first:
                    self.runs[-1] = (self.runs[-1][0], len(rows), None)
                else:
                    self.runs.append((first, len(rows), owner))
            row += len(seqs)
        self.random_rows = torch.tensor(rows, dtype=torch.long)
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        filtered = [i for i, p in enumerate(params) if p.top_p < 1.0 or p.top_k != -1]
        self.filtered = torch.tensor(filtered, dtype=torch.long) if filtered else None
        self.top_k = [params[i].top_k for i in filtered]
        self.top_p = [params[i].top_p for i in filtered]
        self.min_p = (torch.tensor([p.min_p for p in params], dtype=torch.float32)
                      if any(p.min_p > 0.0 for p in params) else None)


def _simple_group(group: SequenceGroup, seqs: list[Sequence]) -> bool:
    p = group.sampling_params
    return (not p.use_beam_search and _num_samples(group) == 1 and not p.logprobs and not p.logprob_token_ids
            and p.min_tokens == 0
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and not p.logit_bias and not p.allowed_token_ids and not p.bad_words_token_ids
            and all(seq.grammar is None for seq in seqs))


def _num_samples(group: SequenceGroup) -> int:
    """Samples drawn per row: best_of from the single row before the first token, else one."""
    params = group.sampling_params
    return params.best_of if group.before_first_token() and not params.greedy else 1


class Sampler:
    """Samples the next token of every running sequence of the scheduled groups."""

    def __init__(self, eos_token_id: Optional[int] = None, seed: Optional[int] = None) -> None:
        self.eos_token_id = eos_token_id
        # Unseeded requests draw from the sampler's own generator (seeded with the engine's --seed), never from
        # torch's global one: the process's random state is not the engine's to set or consume.
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab]
        groups: list[tuple[SequenceGroup, list[Sequence]]],
    ) -> list[list[Sample]]:
        return self.sample(logits, groups)

    def sample(
        self,
        logits: torch.Tensor,  # [num_rows, vocab]
        groups: list[tuple[SequenceGroup, list[Sequence]]],
    ) -> list[list[Sample]]:
        """Every sample of every row, one Sample each: beams, several samples from a row, top logprobs, penalties,
        biases, masks and grammars included."""
        logits = logits.float()
        num_rows, vocab = logits.shape
        assert num_rows == sum(len(seqs) for _, seqs in groups), "one logits row per running sequence"
        raw_logits = logits  # logprobs are reported from these (see the note at the top)
        logits = adjust_logits(logits, [(group.sampling_params, seq) for group, seqs in groups for seq in seqs],
                               self.eos_token_id)
        constrained = [(row, seq.grammar) for row, seq in enumerate(seq for _, seqs in groups for seq in seqs)
                       if seq.grammar is not None and seq.grammar.active]
        if constrained:
            logits = _mask_to_grammars(logits, raw_logits, constrained)
        elif logits is raw_logits and all(_plain_greedy(group.sampling_params) for group, _ in groups):
            return _greedy_samples(raw_logits, groups)

        # Row layout: group i owns rows [starts[i], starts[i] + len(seqs)).
        starts, row = [], 0
        for _, seqs in groups:
            starts.append(row)
            row += len(seqs)

        # One "slot" per sample drawn; slots are laid out group by group in order.
        # Greedy and random slots are filled in one vectorized pass each; beam groups
        # produce (row, token) pairs of their own.
        slot_rows: list[int] = []
        greedy_slots: list[int] = []
        random_slots: list[int] = []
        beam_parts: dict[int, tuple[int, int]] = {}  # group index -> (first slot, count)
        for gi, (group, seqs) in enumerate(groups):
            params = group.sampling_params
            if params.use_beam_search:
                count = 2 * params.best_of
                beam_parts[gi] = (len(slot_rows), count)
                slot_rows.extend([starts[gi]] * count)  # placeholder, replaced below
                continue
            reps = _num_samples(group)
            for r in range(len(seqs)):
                for _ in range(reps):
                    (greedy_slots if params.greedy else random_slots).append(len(slot_rows))
                    slot_rows.append(starts[gi] + r)

        device = logits.device
        slot_rows_t = torch.tensor(slot_rows, dtype=torch.long, device=device)
        slot_tokens = torch.zeros(len(slot_rows), dtype=torch.long, device=device)
        # Each raw row's argmax and logsumexp in one pass (ops.argmax_logsumexp): the greedy tokens
        # when nothing adjusted the logits, and the sampled tokens' logprobs when no top logprobs are asked.
        k = max((g.sampling_params.logprobs or 0) for g, _ in groups) if groups else 0
        raw_stats = ops.argmax_logsumexp(raw_logits) if k == 0 or (greedy_slots and logits is raw_logits) else None
        if greedy_slots:
            # One argmax per row, then picked per slot: no copy of the [num_slots, vocab] rows.
            idx = torch.tensor(greedy_slots, dtype=torch.long, device=device)
            argmax = raw_stats[0] if raw_stats is not None and logits is raw_logits else logits.argmax(dim=-1)
            slot_tokens[idx] = argmax[slot_rows_t[idx]]
        if random_slots:
            idx = torch.tensor(random_slots, dtype=torch.long, device=device)
            slot_tokens[idx] = self._sample_random(logits, groups, starts, slot_rows, random_slots)
        for gi, (first, count) in beam_parts.items():
            group, seqs = groups[gi]
            rows, tokens = beam_candidates(
                torch.log_softmax(logits[starts[gi] : starts[gi] + len(seqs)], dim=-1), seqs, count,
                group.before_first_token(),
            )
            slot_rows_t[first : first + count] = rows + starts[gi]
            slot_tokens[first : first + count] = tokens

        return self._build_samples(raw_logits, raw_stats, k, groups, starts, slot_rows_t, slot_tokens)

    def sample_rows(
        self,
        logits: torch.Tensor | GreedyStats,  # [num_rows, vocab], or a greedy batch's stats
        groups: list[tuple[SequenceGroup, list[Sequence]]],
        batch: Optional[BatchParams] = None,  # the batch's parameters, if kept from an earlier step
    ) -> Optional[RowSamples]:
        """One pass over the batch when every row draws one token with nothing but temperature, top-k / top-p and
        min-p (greedy rows, random rows, seeded rows together); None when some row needs __call__'s path.
        `logits` may be a batch's GreedyStats instead (its rows all greedy: the engine asks for them only then)."""
        if isinstance(logits, GreedyStats):
            if batch is not None and not batch.all_greedy:
                raise ValueError("sample_rows: GreedyStats hold greedy rows only; this batch samples")
            return RowSamples(logits.argmax, logits.max - logits.logsumexp)
        if batch is None:
            batch = BatchParams(groups)
        if not batch.simple:
            return None
        logits = logits.float()
        argmax, lse = ops.argmax_logsumexp(logits)  # [num_rows] each: greedy tokens, and every row's logsumexp
        tokens = argmax
        if not batch.all_greedy:
            tokens = argmax.clone()
            x = logits[batch.random_rows] / batch.temperature.to(logits.device).unsqueeze(1)
            if batch.filtered is not None:
                x[batch.filtered] = apply_top_k_top_p(x[batch.filtered], batch.top_k, batch.top_p)
            probs = torch.softmax(x, dim=-1)
            if batch.min_p is not None:
                probs = apply_min_p(probs, batch.min_p.to(probs.device))
            cdf = probs.cumsum(dim=-1)
            u = torch.empty(len(batch.random_rows), device=logits.device)
            shared = self._shared_generator(logits.device)
            for first, end, owner in batch.runs:
                u[first:end].uniform_(generator=(_generator(owner, logits.device) if owner is not None else shared))
            drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
            tokens[batch.random_rows] = torch.minimum(drawn, cdf.argmax(dim=-1))  # (see _sample_random)
        logprobs = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse
        return RowSamples(tokens, logprobs)

    # ---- random sampling ---------------------------------------------------

    def _sample_random(
        self,
        logits: torch.Tensor,  # [num_rows, vocab]
        groups: list[tuple[SequenceGroup, list[Sequence]]],
        starts: list[int],
        slot_rows: list[int],
        random_slots: list[int],
    ) -> torch.Tensor:  # [len(random_slots)] token ids
        device = logits.device
        # Process each distinct row once, then expand to its best_of slots.
        rows = sorted({slot_rows[s] for s in random_slots})
        row_params = _row_params(groups, starts)
        probs = sampling_probs(logits[torch.tensor(rows, dtype=torch.long, device=device)],
                               [row_params[r] for r in rows])
        pos = {r: i for i, r in enumerate(rows)}
        cdf = probs.cumsum(dim=-1)  # [len(rows), vocab]
        cdf = cdf[torch.tensor([pos[slot_rows[s]] for s in random_slots], dtype=torch.long, device=device)]
        # Inverse-CDF sampling (what torch.multinomial does), with one uniform number
        # per slot: cheap to draw, and each seeded group draws from its own generator.
        u = self._uniforms(len(random_slots), groups, starts, slot_rows, random_slots, device)
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        # u * total can round up to total (p ~ 2^-24): stay on the last token with mass,
        # the first position where the cdf reaches its maximum.
        return torch.minimum(tokens, cdf.argmax(dim=-1))

    def _uniforms(self, n, groups, starts, slot_rows, random_slots, device) -> torch.Tensor:  # [n] in [0, 1)
        u = torch.empty(n, device=device)
        shared = self._shared_generator(device)
        if not any(g.sampling_params.seed is not None for g, _ in groups):
            return u.uniform_(generator=shared)
        # Slots of one group are contiguous; a seeded group draws from its own
        # generator only, so its tokens do not depend on the rest of the batch,
        # and it takes nothing from the generator the others share.
        owner = _row_groups(groups, starts)
        i = 0
        while i < n:
            group = owner[slot_rows[random_slots[i]]]
            j = i
            while j < n and owner[slot_rows[random_slots[j]]] is group:
                j += 1
            u[i:j].uniform_(generator=_generator(group, device) or shared)
            i = j
        return u

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()  # nondeterministic
            else:
                gen.manual_seed(self.seed)
        return gen

    # ---- results -----------------------------------------------------------

    def _build_samples(self, raw_logits, raw_stats, k, groups, starts, slot_rows_t, slot_tokens) -> list[list[Sample]]:
        if k > 0:
            raw_logprobs = torch.log_softmax(raw_logits, dim=-1)  # [num_rows, vocab]
            chosen = raw_logprobs[slot_rows_t, slot_tokens]
        else:
            # Only the sampled tokens' logprobs: logit - logsumexp(row), without writing a
            # [num_rows, vocab] log_softmax (a few ms per decode step on CPU).
            chosen = raw_logits[slot_rows_t, slot_tokens] - raw_stats[1][slot_rows_t]
        parts = [slot_rows_t.double(), slot_tokens.double(), chosen.double()]
        if k > 0:
            top_vals, top_ids = raw_logprobs.topk(k, dim=-1)  # [num_rows, k]
            parts += [top_ids.double().flatten(), top_vals.double().flatten()]
        named_at: dict[int, int] = {}  # row -> where its named tokens' logprobs start in the named part
        named_rows, named_ids = [], []
        for gi, (group, seqs) in enumerate(groups):
            ids = group.sampling_params.logprob_token_ids
            for row in range(starts[gi], starts[gi] + len(seqs)) if ids else ():
                named_at[row] = len(named_rows)
                named_rows += [row] * len(ids)
                named_ids += ids
        if named_rows:  # logprob_token_ids: each row's named tokens, from the raw logits as every logprob here
            rows_t = torch.tensor(named_rows, dtype=torch.long, device=raw_logits.device)
            ids_t = torch.tensor(named_ids, dtype=torch.long, device=raw_logits.device)
            named = (raw_logprobs[rows_t, ids_t] if k > 0
                     else raw_logits[rows_t, ids_t] - raw_stats[1][rows_t])  # [len(named_rows)]
            parts.append(named.double())
        flat = torch.cat(parts).tolist()  # the one device -> host transfer
        n = len(slot_rows_t)
        rows, tokens, lps = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
        num_rows = raw_logits.shape[0]
        top_ids_l = flat[3 * n : 3 * n + num_rows * k]
        top_vals_l = flat[3 * n + num_rows * k : 3 * n + 2 * num_rows * k]
        named_l = flat[3 * n + 2 * num_rows * k :]

        out: list[list[Sample]] = []
        slot = 0
        for gi, (group, seqs) in enumerate(groups):
            params = group.sampling_params
            count = 2 * params.best_of if params.use_beam_search else len(seqs) * _num_samples(group)
            want = params.logprobs or 0
            named_ids = params.logprob_token_ids or ()
            samples = []
            for s in range(slot, slot + count):
                row, token = int(rows[s]), int(tokens[s])
                logprobs = {token: lps[s]}
                base = row * k
                for j in range(want):
                    logprobs.setdefault(int(top_ids_l[base + j]), top_vals_l[base + j])
                at = named_at.get(row, 0)
                for j, named_id in enumerate(named_ids):
                    logprobs.setdefault(named_id, named_l[at + j])
                samples.append(Sample(seqs[row - starts[gi]].seq_id, token, logprobs))
            out.append(samples)
            slot += count
        return out


def _plain_greedy(params: SamplingParams) -> bool:
    # (greedy excludes beam search; one sample a row: _num_samples)
    return params.greedy and not params.logprobs and not params.logprob_token_ids


def _greedy_samples(logits: torch.Tensor, groups: list[tuple[SequenceGroup, list[Sequence]]]) -> list[list[Sample]]:
    """Every row greedy, without top logprobs, on logits nothing adjusted: each row's argmax and its logprob
    (logit - logsumexp), the same values as the slot path's, from one kernel call and two host transfers.

    The common chat request's step: the slot path's ~15 small tensor ops cost ~0.2 ms of a one-stream decode step
    (its caches are cold after the forward's weight stream), ~2 % of the step."""
    argmax, lse = ops.argmax_logsumexp(logits)
    tokens = argmax.tolist()
    lps = (logits.gather(1, argmax.unsqueeze(1)).squeeze(1) - lse).tolist()
    out: list[list[Sample]] = []
    row = 0
    for _, seqs in groups:
        samples = []
        for seq in seqs:
            samples.append(Sample(seq.seq_id, tokens[row], {tokens[row]: lps[row]}))
            row += 1
        out.append(samples)
    return out


def _mask_to_grammars(logits: torch.Tensor, raw_logits: torch.Tensor, constrained) -> torch.Tensor:
    """Structured outputs: the constrained rows keep only the tokens their grammar allows next. A row the
    other adjustments had already emptied of those (min_tokens holding back the EOS the grammar needs now)
    keeps the grammar's choice over the raw logits: the grammar wins."""
    if logits is raw_logits:  # nothing else masked a token (a row its grammar empties ends at the refused token)
        logits = logits.clone()
        apply_grammar_masks(logits, constrained)
        return logits
    apply_grammar_masks(logits, constrained)
    rows = torch.tensor([row for row, _ in constrained], dtype=torch.long, device=logits.device)
    empty = torch.isneginf(logits[rows]).all(dim=-1)
    if bool(empty.any()):
        stuck = [(row, state) for (row, state), e in zip(constrained, empty.tolist()) if e]
        for row, _ in stuck:
            logits[row] = raw_logits[row]
        apply_grammar_masks(logits, stuck)
    return logits


def _row_params(groups, starts) -> dict[int, SamplingParams]:
    return {starts[gi] + r: g.sampling_params for gi, (g, seqs) in enumerate(groups) for r in range(len(seqs))}


def _row_groups(groups, starts) -> dict[int, SequenceGroup]:
    return {starts[gi] + r: g for gi, (g, seqs) in enumerate(groups) for r in range(len(seqs))}


def _generator(group: SequenceGroup, device: torch.device) -> Optional[torch.Generator]:
    """The group's own seeded generator (created on first use), or None for the sampler's shared one."""
    seed = group.sampling_params.seed
    if seed is None:
        return None
    if group.generator is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        group.generator = gen
    return group.generator
