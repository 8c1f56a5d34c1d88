"""Prompt logprobs, owned here: which prompts want them, which positions' logits feed them, and how the
chunks of a prompt add up to one entry per prompt token.

Entry i of SequenceGroup.prompt_logprobs is prompt token i's logprob given tokens 0 .. i-1 (entry 0 is None),
plus the top-k alternatives; it comes from the logits at position i - 1. The logits are the raw model's, as
vLLM v0.2 and OpenAI report them. The block manager never serves such a prompt from the prefix cache (every
position's logits are needed), so its prompt is computed from token 0, whole or in chunks, in order.
Which requests want them: `SequenceGroup.wants_prompt_logprobs` (the block manager asks it too).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from engine.sequence import Logprobs, Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    import torch

    from engine.core.scheduler import SchedulerOutput


def logits_positions(group: SequenceGroup, seq: Sequence, start: int, end: int) -> int:
    """How many of the positions [start, end) computed this step feed prompt logprobs (the leading ones)."""
    if not group.wants_prompt_logprobs:
        return 0
    return max(min(end, len(seq.prompt_token_ids)) - start, 0)


def add_prompt_logprobs(out: SchedulerOutput, prompt_logits: dict[str, torch.Tensor]) -> None:
    """After the forward, before update_computed (each chunk starts at its sequence's num_computed_tokens):
    extend each group's prompt_logprobs with this step's chunk of prompt logits.

    Raises RuntimeError if a chunk does not continue the entries already there: a gap would misalign every
    later entry with its token.
    """
    for scheduled in out.scheduled:
        group = scheduled.group
        logits = prompt_logits.get(group.request_id)  # [num_positions, vocab]
        if logits is None:
            continue
        start = group.get_seqs(SequenceStatus.RUNNING)[0].num_computed_tokens
        prompt = group.prompt_token_ids
        have = group.prompt_logprobs
        if have is not None and len(have) == len(prompt):
            continue  # complete: a prompt computed again after a recompute preemption keeps its entries
        if start == 0:
            have = group.prompt_logprobs = []
        elif have is None or len(have) != start + 1:
            expected = "position 0" if have is None else f"position {len(have) - 1}, after its {len(have)} entries"
            raise RuntimeError(f"prompt logprobs of request {group.request_id!r}: a chunk starts at position "
                               f"{start}, but the next one must start at {expected}.")
        k = group.sampling_params.prompt_logprobs
        have.extend(compute_prompt_logprobs(logits, prompt[: start + logits.shape[0] + 1], k, start))


def compute_prompt_logprobs(
    logits: torch.Tensor,  # [num_positions, vocab]: the logits of prompt positions start, start + 1, ...
    prompt_token_ids: list[int],
    k: int,
    start: int = 0,
) -> list[Optional[Logprobs]]:
    """Logprob of each prompt token given the ones before it, plus the top-k.

    From the whole prompt (start 0): one entry per token, entry 0 None. From a later chunk of it: the entries of
    tokens start + 1 .. start + len(logits), as far as prompt_token_ids goes.
    """
    n = len(prompt_token_ids)
    out: list[Optional[Logprobs]] = [None] if start == 0 else []
    rows = min(logits.shape[0], n - 1 - start)  # row i predicts token start + i + 1
    if rows <= 0:
        return out if n else []
    logprobs = logits[:rows].float().log_softmax(dim=-1)
    targets = prompt_token_ids[start + 1 : start + 1 + rows]
    chosen = logprobs[list(range(rows)), targets].tolist()
    if k > 0:
        top_vals, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    else:
        top_vals, top_ids = [[]] * rows, [[]] * rows
    for i in range(rows):
        entry = {targets[i]: chosen[i]}
        for tid, val in zip(top_ids[i], top_vals[i]):
            entry.setdefault(tid, val)
        out.append(entry)
    return out
