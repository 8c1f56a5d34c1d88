"""Logit transforms: pure functions from logits to adjusted logits, distributions and beam candidates.

The sampler (engine/sample/sampler.py) decides which rows get which transform and draws the tokens; nothing here
knows about slots, rows of groups or generators.
"""
from __future__ import annotations

from typing import Optional

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def adjust_logits(
    logits: torch.Tensor,  # [num_rows, vocab]
    rows_params: list[tuple[SamplingParams, Sequence]],  # one per row
    eos_token_id: Optional[int],
) -> torch.Tensor:  # [num_rows, vocab]; the input itself when nothing applies
    """Penalties, logit_bias, min_tokens, allowed_token_ids and bad words, in vLLM's order; a copy only when
    something applies."""
    vocab = logits.shape[-1]
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
                if eos_token_id is not None and not params.ignore_eos:
                    stop_ids.append(eos_token_id)
                logits[r, [t for t in stop_ids if t < vocab]] = float("-inf")
            if params.allowed_token_ids:
                allowed = torch.full((vocab,), float("-inf"), dtype=logits.dtype, device=logits.device)
                allowed[[t for t in params.allowed_token_ids if t < vocab]] = 0.0
                logits[r] += allowed
            banned = _bad_word_ends(params, seq)
            if banned:
                logits[r, [t for t in banned if t < vocab]] = float("-inf")
    return logits


def sampling_probs(
    logits: torch.Tensor,  # [num_rows, vocab], adjusted
    params: list[SamplingParams],  # one per row
) -> torch.Tensor:  # [num_rows, vocab]
    """The distribution a random row samples from: temperature, then top-k / top-p, then min-p."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    x = logits / temps.unsqueeze(1)
    filtered = [i for i, p in enumerate(params) if p.top_p < 1.0 or p.top_k != -1]
    if filtered:
        idx = torch.tensor(filtered, dtype=torch.long, device=device)
        x[idx] = apply_top_k_top_p(x[idx], [params[i].top_k for i in filtered], [params[i].top_p for i in filtered])
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        probs = apply_min_p(probs, torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device))
    return probs


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _blocks_stop(params: SamplingParams, seq: Sequence) -> bool:
    return seq.get_output_len() < params.min_tokens


def _bad_word_ends(params: SamplingParams, seq: Sequence) -> list[int]:
    """The last token of every bad word whose earlier tokens end the output so far (vLLM's NoBadWords rule)."""
    out = seq.output_token_ids
    return [word[-1] for word in params.bad_words_token_ids or ()
            if len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:] == word[:-1]]


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


def beam_candidates(
    logprobs: torch.Tensor,  # [num_beams, vocab], adjusted
    seqs: list[Sequence],  # the group's RUNNING beams, one per row
    count: int,
    first_token: bool,  # the one row before the first token: the best `count` tokens of it
) -> tuple[torch.Tensor, torch.Tensor]:  # ([count] beam index, [count] token id)
    """The best `count` (beam, token) extensions by cumulative logprob, as vLLM v0.2 does."""
    vocab = logprobs.shape[-1]
    if first_token:
        _, tokens = logprobs[0].topk(count)
        return torch.zeros_like(tokens), tokens
    cum = torch.tensor([s.cumulative_logprob for s in seqs], dtype=logprobs.dtype, device=logprobs.device)
    _, flat = (logprobs + cum.unsqueeze(1)).flatten().topk(count)
    return flat // vocab, flat % vocab
