"""Prompt logprobs across chunks: one entry per prompt token, and an error, not a silent gap, on a misfit."""
import pytest
import torch

from engine.sample.prompt_logprobs import add_prompt_logprobs, compute_prompt_logprobs
from engine.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledGroup, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

VOCAB = 50


def chunk_step(group: SequenceGroup, logits: torch.Tensor, num_tokens: int) -> None:
    """A prefill chunk of num_tokens as the engine runs it: logits in, then the tokens are computed."""
    seq = group.seqs[0]
    scheduled = ScheduledGroup(group, True, num_tokens, seq.num_computed_tokens + num_tokens == seq.get_len())
    add_prompt_logprobs(SchedulerOutput(scheduled=[scheduled]), {group.request_id: logits})
    seq.num_computed_tokens += num_tokens


def make_group(prompt: list[int]) -> SequenceGroup:
    seq = Sequence(0, prompt)
    seq.status = SequenceStatus.RUNNING
    return SequenceGroup("r", [seq], SamplingParams(prompt_logprobs=2))


def test_chunks_add_up_to_the_whole_prompts_entries():
    prompt = [3, 17, 2, 40, 9, 11, 5]
    logits = torch.randn(len(prompt), VOCAB, generator=torch.Generator().manual_seed(3))
    whole = compute_prompt_logprobs(logits, prompt, 2)
    group = make_group(prompt)
    for a, b in ((0, 3), (3, 4), (4, 7)):
        chunk_step(group, logits[a:b], b - a)
    assert group.prompt_logprobs == whole and len(whole) == len(prompt)


def test_a_chunk_that_does_not_continue_the_entries_is_an_error():
    prompt = [3, 17, 2, 40, 9, 11, 5]
    logits = torch.randn(len(prompt), VOCAB, generator=torch.Generator().manual_seed(4))
    group = make_group(prompt)
    chunk_step(group, logits[0:3], 3)
    group.seqs[0].num_computed_tokens = 4  # one position skipped: its entry would be missing
    with pytest.raises(RuntimeError, match="starts at position 4, but the next one must start at position 3"):
        chunk_step(group, logits[4:7], 3)


def test_a_one_token_prompt_has_one_entry():
    group = make_group([7])
    chunk_step(group, torch.randn(1, VOCAB), 1)
    assert group.prompt_logprobs == [None]
