"""argmax_logsumexp (the greedy token and the sampled token's logprob of each row) equals torch's argmax and
logsumexp: the first maximum on ties, -inf for a fully masked row, vocabularies with vector tails."""
from __future__ import annotations

import pytest
import torch

from engine import ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 1000, 49152, 49153])
def test_argmax_logsumexp_matches_torch(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=gen) * 8).to(dtype)
    logits[0] = 1.5  # every token tied: index 0
    if vocab > 9:
        logits[1, 3] = logits[1, 9] = 200.0  # a tie between two tokens: the first wins
        logits[1, vocab - 1] = 200.0  # and one in the scalar tail
    logits[2] = float("-inf")  # fully masked
    logits[3, : max(vocab - 1, 1)] = float("-inf")  # masked but the last
    argmax, lse = ops.argmax_logsumexp(logits)
    assert argmax.dtype == torch.int64 and lse.dtype == torch.float32
    assert argmax.tolist() == logits.argmax(dim=-1).tolist()
    expected = logits.float().logsumexp(dim=-1)
    assert torch.isneginf(lse[2]) and torch.isneginf(expected[2])
    finite = torch.isfinite(expected)
    torch.testing.assert_close(lse[finite], expected[finite], atol=1e-5, rtol=1e-5)


def test_argmax_logsumexp_on_a_decode_batch_in_parallel():
    """32 x 49152: past the one-thread limit, so rows are split over the OpenMP team."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 49152, generator=gen) * 5
    argmax, lse = ops.argmax_logsumexp(logits)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, logits.logsumexp(dim=-1), atol=1e-5, rtol=1e-5)
    # The logprob a sampler reports for row r's greedy token.
    torch.testing.assert_close(logits.max(dim=-1).values - lse, torch.log_softmax(logits, -1).max(dim=-1).values,
                               atol=1e-5, rtol=1e-5)


def test_argmax_logsumexp_on_row_views():
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 300, generator=gen)
    view = wide[:, :250]  # rows 300 apart
    argmax, lse = ops.argmax_logsumexp(view)
    assert torch.equal(argmax, view.argmax(dim=-1))
    torch.testing.assert_close(lse, view.logsumexp(dim=-1))
