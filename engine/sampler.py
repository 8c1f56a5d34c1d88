"""Turns one step's logits into tokens: penalties, greedy / random / beam choice, logprobs."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from engine import ops
from engine.sampling_params import SamplingParams
from engine.sequence import Logprobs, Sequence, SequenceGroup

# Logprobs reported to the client (Sample.logprobs, cumulative_logprob; prompt logprobs too,
# engine/prompt_logprobs.py) are log_softmax of the RAW model logits, before penalties, bias or temperature:
# that is what vLLM v0.2 and OpenAI report, and what HF's log_softmax parity check expects.
# Beam search ranks candidates with the log_softmax of the ADJUSTED logits
# (penalties, bias, min_tokens) so that e.g. a masked EOS can never be chosen.


class Sample(NamedTuple):
    parent_seq_id: int
    token_id: int
    logprobs: Logprobs  # the sampled token plus the top-`logprobs` alternatives


def _num_samples(group: SequenceGroup) -> int:
    """Samples drawn per row: best_of from the single row before the first token, else one."""
    params = group.sampling_params
    return params.best_of if group.before_first_token() and not params.greedy else 1


class Sampler:
    """Samples the next token of every running sequence of the scheduled groups."""

    def __init__(self, eos_token_id: Optional[int] = None) -> None:
        self.eos_token_id = eos_token_id

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab]
        groups: list[tuple[SequenceGroup, list[Sequence]]],
    ) -> list[list[Sample]]:
        logits = logits.float()
        num_rows, vocab = logits.shape
        assert num_rows == sum(len(seqs) for _, seqs in groups), "one logits row per running sequence"
        raw_logits = logits  # logprobs are reported from these (see the note at the top)
        logits = self._adjust(logits, groups)

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
            rows, tokens = _beam_candidates(
                torch.log_softmax(logits[starts[gi] : starts[gi] + len(seqs)], dim=-1), group, seqs, count
            )
            slot_rows_t[first : first + count] = rows + starts[gi]
            slot_tokens[first : first + count] = tokens

        return self._build_samples(raw_logits, raw_stats, k, groups, starts, slot_rows_t, slot_tokens)

    # ---- logit adjustments -------------------------------------------------

    def _adjust(self, logits: torch.Tensor, groups: list[tuple[SequenceGroup, list[Sequence]]]) -> torch.Tensor:
        """Penalties, logit_bias and min_tokens, in vLLM's order; a copy only when something applies."""
        vocab = logits.shape[-1]
        rows_params = [(group.sampling_params, seq) for group, seqs in groups for seq in seqs]
        if any(_has_penalty(p) for p, _ in rows_params):
            logits = apply_penalties(logits, rows_params)
        extra = [(r, p, s) for r, (p, s) in enumerate(rows_params)
                 if p.logit_bias or _blocks_stop(p, s) or p.allowed_token_ids or p.bad_words_token_ids]
        if extra:
            logits = logits.clone()
            for r, params, seq in extra:
                if params.logit_bias:
                    # Ids outside the vocabulary cannot be sampled anyway; ignore their bias.
                    bias = {t: b for t, b in params.logit_bias.items() if 0 <= t < vocab}
                    ids = torch.tensor(list(bias.keys()), dtype=torch.long, device=logits.device)
                    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
                    logits[r].index_add_(0, ids, values)
                if _blocks_stop(params, seq):
                    stop_ids = list(params.stop_token_ids)
                    if self.eos_token_id is not None and not params.ignore_eos:
                        stop_ids.append(self.eos_token_id)
                    logits[r, [t for t in stop_ids if t < vocab]] = float("-inf")
                if params.allowed_token_ids:
                    allowed = torch.full((vocab,), float("-inf"), dtype=logits.dtype, device=logits.device)
                    allowed[[t for t in params.allowed_token_ids if t < vocab]] = 0.0
                    logits[r] += allowed
                banned = _bad_word_ends(params, seq)
                if banned:
                    logits[r, [t for t in banned if t < vocab]] = float("-inf")
        return logits

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
        params = [row_params[r] for r in rows]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        x = logits[torch.tensor(rows, dtype=torch.long, device=device)] / temps.unsqueeze(1)
        filtered = [i for i, p in enumerate(params) if p.top_p < 1.0 or p.top_k != -1]
        if filtered:
            idx = torch.tensor(filtered, dtype=torch.long, device=device)
            x[idx] = apply_top_k_top_p(x[idx], [params[i].top_k for i in filtered], [params[i].top_p for i in filtered])
        probs = torch.softmax(x, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            probs = apply_min_p(probs, torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device))
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
        if not any(g.sampling_params.seed is not None for g, _ in groups):
            return u.uniform_()
        # Slots of one group are contiguous; a seeded group draws from its own
        # generator only, so its tokens do not depend on the rest of the batch,
        # and it takes nothing from the global generator the others share.
        owner = _row_groups(groups, starts)
        i = 0
        while i < n:
            group = owner[slot_rows[random_slots[i]]]
            j = i
            while j < n and owner[slot_rows[random_slots[j]]] is group:
                j += 1
            u[i:j].uniform_(generator=_generator(group, device))
            i = j
        return u

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
        flat = torch.cat(parts).tolist()  # the one device -> host transfer
        n = len(slot_rows_t)
        rows, tokens, lps = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
        num_rows = raw_logits.shape[0]
        top_ids_l = flat[3 * n : 3 * n + num_rows * k]
        top_vals_l = flat[3 * n + num_rows * k :]

        out: list[list[Sample]] = []
        slot = 0
        for gi, (group, seqs) in enumerate(groups):
            params = group.sampling_params
            count = 2 * params.best_of if params.use_beam_search else len(seqs) * _num_samples(group)
            want = params.logprobs or 0
            samples = []
            for s in range(slot, slot + count):
                row, token = int(rows[s]), int(tokens[s])
                logprobs = {token: lps[s]}
                base = row * k
                for j in range(want):
                    logprobs.setdefault(int(top_ids_l[base + j]), top_vals_l[base + j])
                samples.append(Sample(seqs[row - starts[gi]].seq_id, token, logprobs))
            out.append(samples)
            slot += count
        return out


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _blocks_stop(params: SamplingParams, seq: Sequence) -> bool:
    return seq.get_output_len() < params.min_tokens


def _bad_word_ends(params: SamplingParams, seq: Sequence) -> list[int]:
    """The last token of every bad word whose earlier tokens end the output so far (vLLM's NoBadWords rule)."""
    out = seq.output_token_ids
    return [word[-1] for word in params.bad_words_token_ids or ()
            if len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:] == word[:-1]]


def _row_params(groups, starts) -> dict[int, SamplingParams]:
    return {starts[gi] + r: g.sampling_params for gi, (g, seqs) in enumerate(groups) for r in range(len(seqs))}


def _row_groups(groups, starts) -> dict[int, SequenceGroup]:
    return {starts[gi] + r: g for gi, (g, seqs) in enumerate(groups) for r in range(len(seqs))}


def _generator(group: SequenceGroup, device: torch.device) -> Optional[torch.Generator]:
    """The group's own seeded generator (created on first use), or None for the global one."""
    seed = group.sampling_params.seed
    if seed is None:
        return None
    if group.generator is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        group.generator = gen
    return group.generator


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab]
    rows_params: list[tuple[SamplingParams, Sequence]],
) -> torch.Tensor:  # [num_rows, vocab], a new tensor
    """Repetition penalty over prompt+output (HF), then frequency and presence over output (OpenAI)."""
    num_rows, vocab = logits.shape
    device = logits.device
    out_ids = _pad([s.output_token_ids for _, s in rows_params], vocab, device)  # [num_rows, max_out]
    counts = torch.zeros(num_rows, vocab + 1, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
    counts = counts[:, :vocab]  # the padding column vocab is dropped
    rep = torch.tensor([p.repetition_penalty for p, _ in rows_params], dtype=logits.dtype, device=device)
    logits = logits.clone()
    if (rep != 1.0).any():
        prompt_ids = _pad([s.prompt_token_ids for _, s in rows_params], vocab, device)
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        rep_rows = rep.unsqueeze(1).expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep_rows, logits * rep_rows)
        logits = torch.where(seen, penalised, logits)
    freq = torch.tensor([p.frequency_penalty for p, _ in rows_params], dtype=logits.dtype, device=device)
    pres = torch.tensor([p.presence_penalty for p, _ in rows_params], dtype=logits.dtype, device=device)
    logits -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def _pad(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.long, device=device).reshape(
        len(lists), width
    )


# On CPU a full vocabulary sort per row costs more than the model's decode step;
# top-p usually keeps a few dozen tokens, so first try the best _HEAD of each row.
_HEAD = 256


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab]
    top_k: list[int],  # -1 = off
    top_p: list[float],  # 1.0 = off
) -> torch.Tensor:  # [num_rows, vocab] with excluded tokens at -inf
    """HF's TopK then TopP warpers, row by row parameters; every row must enable at least one."""
    vocab = logits.shape[-1]
    ks = [vocab if t < 0 else min(t, vocab) for t in top_k]
    k = torch.tensor(ks, device=logits.device)
    p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device)
    head = max(ks)
    if head > _HEAD and not logits.is_cuda and all(t == -1 or t <= _HEAD for t in top_k):
        # Rows with top_k <= _HEAD are exact in the head; the others (top-p only)
        # are exact when the head already holds at least top_p of their mass.
        vals = logits.topk(_HEAD, dim=-1).values
        mass = (vals.logsumexp(-1) - logits.logsumexp(-1)).exp()
        if bool(((k <= _HEAD) | (mass > p)).all()):
            head = _HEAD
    if head < vocab:
        vals, order = logits.topk(head, dim=-1)  # descending
    else:
        vals, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(head, device=logits.device)
    vals = vals.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    # Top-p over the top-k survivors (normalised over them, as HF's warpers chain):
    # drop a token once the tokens above it already hold top_p of the mass.
    lse = torch.where(k.unsqueeze(1) <= head, vals.logsumexp(-1, keepdim=True), logits.logsumexp(-1, keepdim=True))
    mass_above = (vals - lse).exp().cumsum(dim=-1) - (vals - lse).exp()
    vals = vals.masked_fill((mass_above >= p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, vals)


def apply_min_p(
    probs: torch.Tensor,  # [num_rows, vocab]
    min_p: torch.Tensor,  # [num_rows]
) -> torch.Tensor:  # [num_rows, vocab], renormalised
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _beam_candidates(
    logprobs: torch.Tensor,  # [num_beams, vocab], adjusted
    group: SequenceGroup,
    seqs: list[Sequence],  # the group's RUNNING beams, one per row
    count: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([count] beam index, [count] token id)
    """The best `count` (beam, token) extensions by cumulative logprob, as vLLM v0.2 does."""
    vocab = logprobs.shape[-1]
    if group.before_first_token():
        _, tokens = logprobs[0].topk(count)
        return torch.zeros_like(tokens), tokens
    cum = torch.tensor([s.cumulative_logprob for s in seqs], dtype=logprobs.dtype, device=logprobs.device)
    _, flat = (logprobs + cum.unsqueeze(1)).flatten().topk(count)
    return flat // vocab, flat % vocab
