"""Sampler against plain reference implementations (and HF's logits processors where they exist)."""
import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sample.prompt_logprobs import compute_prompt_logprobs
from engine.sample.logits_transforms import apply_min_p, apply_penalties, apply_top_k_top_p
from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

VOCAB = 50
EOS = 7
_ids = itertools.count()


def make_group(params: SamplingParams, prompt=(1, 2, 3), outputs=(), num_seqs=1):
    """A RUNNING group whose sequences already hold `outputs` (logprob 0 each)."""
    seqs = []
    for _ in range(num_seqs):
        seq = Sequence(next(_ids), list(prompt))
        for t in outputs:
            seq.append_token(t, {t: 0.0})
        seq.status = SequenceStatus.RUNNING
        seqs.append(seq)
    return SequenceGroup(f"r{next(_ids)}", seqs, params), seqs


def rand_logits(rows, seed=0, vocab=VOCAB):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    logits = rand_logits(4)
    groups = [make_group(SamplingParams(temperature=0.0, logprobs=3)) for _ in range(4)]
    out = Sampler(EOS)(logits, groups)
    ref = torch.log_softmax(logits, dim=-1)
    for r, (samples, (_, seqs)) in enumerate(zip(out, groups)):
        (s,) = samples
        assert s.parent_seq_id == seqs[0].seq_id
        assert s.token_id == int(logits[r].argmax())
        top = ref[r].topk(3)
        assert set(s.logprobs) == set(top.indices.tolist())
        for t, lp in s.logprobs.items():
            assert lp == pytest.approx(float(ref[r, t]), abs=1e-6)


def test_a_plain_greedy_batch_samples_what_the_slot_path_samples():
    # Every row greedy without top logprobs takes the one-kernel path; one random row sends the same logits
    # through the slot path. The greedy rows get the same tokens (the first index on a tie) and bit-equal logprobs.
    logits = rand_logits(5, seed=3)
    logits[1, 4] = logits[1, 9] = logits[1].max() + 1.0  # a tie: the first index wins, as torch.argmax
    plain = [make_group(SamplingParams(temperature=0.0, logprobs=0 if r % 2 else None)) for r in range(5)]
    fast = [s for samples in Sampler(EOS)(logits, plain) for s in samples]
    mixed = plain[:-1] + [make_group(SamplingParams(temperature=1.0, seed=1))]
    slot = [s for samples in Sampler(EOS)(logits, mixed) for s in samples]
    ref = torch.log_softmax(logits, dim=-1)
    assert [s.token_id for s in fast] == logits.argmax(dim=-1).tolist() and fast[1].token_id == 4
    assert [s.parent_seq_id for s in fast] == [seqs[0].seq_id for _, seqs in plain]
    for r, s in enumerate(fast):
        assert s.logprobs == {s.token_id: pytest.approx(float(ref[r, s.token_id]), abs=1e-5)}
        if r < 4:
            assert s == slot[r]


def test_logprobs_hold_the_sampled_token_even_outside_the_top_k():
    logits = torch.zeros(1, VOCAB)
    logits[0, :5] = 10.0
    group = make_group(SamplingParams(temperature=1.0, logprobs=2, logit_bias={30: 100.0}))
    (s,), = Sampler(EOS)(logits, [group])
    assert s.token_id == 30  # the bias decides; the reported logprob is the raw model's
    assert len(s.logprobs) == 3 and 30 in s.logprobs
    assert s.logprobs[30] == pytest.approx(float(torch.log_softmax(logits[0], -1)[30]), abs=1e-6)


@pytest.mark.parametrize("vocab", [VOCAB, 5000])  # 5000: the top-_HEAD shortcut and its fallback
@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (-1, 0.3), (-1, 0.9), (-1, 0.999), (10, 0.5),
                                         (300, 0.9), (VOCAB + 5, 0.99)])
def test_top_k_top_p_mask_matches_hf(top_k, top_p, vocab):
    logits = rand_logits(3, seed=top_k, vocab=vocab)
    ours = apply_top_k_top_p(logits, [top_k] * 3, [top_p] * 3)
    ref = logits.clone()
    if top_k != -1:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])


def test_top_k_top_p_per_row_parameters():
    logits = rand_logits(3, seed=5)
    ours = apply_top_k_top_p(logits, [2, -1, 4], [1.0, 0.5, 0.8])
    for r, (k, p) in enumerate([(2, 1.0), (-1, 0.5), (4, 0.8)]):
        ref = logits[r : r + 1].clone()
        if k != -1:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1.0:
            ref = TopPLogitsWarper(p)(None, ref)
        assert torch.equal(torch.isinf(ours[r : r + 1]), torch.isinf(ref))


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.9])
def test_min_p_matches_hf(min_p):
    logits = rand_logits(2, seed=3)
    ours = apply_min_p(torch.softmax(logits, -1), torch.full((2,), min_p))
    ref = torch.softmax(MinPLogitsWarper(min_p)(None, logits.clone()), -1)
    torch.testing.assert_close(ours, ref)


def test_random_sampling_only_draws_from_the_allowed_set_and_follows_the_distribution():
    # 4000 rows of the same 4-token distribution, sampled in one call.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = torch.full((VOCAB,), -float("inf"))
    row[:4] = probs.log()
    groups = [make_group(SamplingParams(temperature=1.0)) for _ in range(4000)]
    tokens = [s[0].token_id for s in Sampler(EOS, seed=0)(row.expand(4000, VOCAB).clone(), groups)]
    freq = torch.bincount(torch.tensor(tokens), minlength=VOCAB)[:4].float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    assert max(tokens) < 4
    # top_k=2 and top_p=0.6 leave only the two most likely tokens; min_p=0.5 leaves 0 and 1 too.
    for params in (SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(min_p=0.5)):
        groups = [make_group(params) for _ in range(500)]
        tokens = {s[0].token_id for s in Sampler(EOS)(row.expand(500, VOCAB).clone(), groups)}
        assert tokens == {0, 1}


def test_temperature_sharpens():
    row = torch.zeros(1, VOCAB)
    row[0, 0], row[0, 1] = 1.0, 0.0
    groups = [make_group(SamplingParams(temperature=0.05)) for _ in range(300)]
    tokens = {s[0].token_id for s in Sampler(EOS)(row.expand(300, VOCAB).clone(), groups)}
    assert tokens == {0}


def test_repetition_penalty_matches_hf_over_prompt_and_output():
    logits = rand_logits(2, seed=9)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7)]
    seqs = [make_group(params[0], prompt=(1, 4, 4), outputs=(9, 1))[1][0],
            make_group(params[1], prompt=(2,), outputs=(20, 21, 2))[1][0]]
    ours = apply_penalties(logits, list(zip(params, seqs)))
    for r in range(2):
        ids = torch.tensor([seqs[r].all_token_ids])
        ref = RepetitionPenaltyLogitsProcessor(params[r].repetition_penalty)(ids, logits[r : r + 1].clone())
        torch.testing.assert_close(ours[r : r + 1], ref)


def test_presence_and_frequency_follow_openai_over_output_tokens_only():
    logits = rand_logits(1, seed=11)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    _, (seq,) = make_group(params, prompt=(3, 3, 3), outputs=(5, 5, 6))
    ours = apply_penalties(logits, [(params, seq)])
    ref = logits.clone()
    for t in set(seq.output_token_ids):
        count = seq.output_token_ids.count(t)
        ref[0, t] -= count * 0.25 + 0.5  # OpenAI: mu[j] - c[j] * a_freq - (c[j] > 0) * a_presence
    torch.testing.assert_close(ours, ref)
    assert ours[0, 3] == logits[0, 3]  # prompt tokens are not penalised


def test_penalties_change_the_greedy_choice_only_for_their_row():
    logits = torch.zeros(2, VOCAB)
    logits[:, 4], logits[:, 8] = 2.0, 1.9
    penalised = make_group(SamplingParams(temperature=0.0, frequency_penalty=1.0), outputs=(4,))
    plain = make_group(SamplingParams(temperature=0.0), outputs=(4,))
    out = Sampler(EOS)(logits, [penalised, plain])
    assert [o[0].token_id for o in out] == [8, 4]


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 5.0
    logits[:, 12] = 4.0
    logits[:, 13] = 3.0
    biased = make_group(SamplingParams(temperature=0.0, logit_bias={40: 10.0, EOS: -100.0}))
    blocked = make_group(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[12]), outputs=(1,))
    free = make_group(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[12]), outputs=(1, 1))
    out = Sampler(EOS)(logits, [biased, blocked, free])
    # min_tokens masks EOS and stop_token_ids until min_tokens outputs exist, then lets EOS win.
    assert [o[0].token_id for o in out] == [40, 13, EOS]


def test_seeded_requests_reproduce_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234, n=2)

    def run(batch_builder, steps=4):
        group, seqs = make_group(params, outputs=(1,), num_seqs=2)
        tokens = []
        for step in range(steps):
            batch = batch_builder((group, seqs))
            logits = torch.cat([rand_logits(len(s), seed=100 + step + 7 * i) if g is not group
                                else rand_logits(2, seed=step) for i, (g, s) in enumerate(batch)])
            out = Sampler(EOS)(logits, batch)
            tokens.append([x.token_id for x in out[batch.index((group, seqs))]])
        return tokens

    alone = run(lambda me: [me])
    others = [make_group(SamplingParams(temperature=1.0)) for _ in range(3)]
    seeded_other = make_group(SamplingParams(temperature=0.8, seed=5, top_p=0.9))
    assert run(lambda me: [others[0], me, others[1]]) == alone
    assert run(lambda me: [seeded_other, others[2], me]) == alone
    assert run(lambda me: [me, make_group(SamplingParams(temperature=0.0))]) == alone
    assert len({t for step in alone for t in step}) > 1  # it really is random


def test_seeded_rows_do_not_consume_the_shared_generator():
    logits = rand_logits(1, seed=1)
    alone = Sampler(EOS, seed=7)(logits, [make_group(SamplingParams(temperature=1.0, best_of=3))])
    seeded = make_group(SamplingParams(temperature=1.0, seed=3, best_of=2))
    mixed = Sampler(EOS, seed=7)(torch.cat([rand_logits(1, seed=2), logits]),
                                 [seeded, make_group(SamplingParams(temperature=1.0, best_of=3))])
    assert [s.token_id for s in mixed[1]] == [s.token_id for s in alone[0]]


def test_best_of_samples_from_the_single_row_then_one_per_row():
    logits = rand_logits(1)
    group, (seq,) = make_group(SamplingParams(n=2, best_of=5, temperature=1.0))
    (samples,) = Sampler(EOS)(logits, [(group, [seq])])
    assert len(samples) == 5 and {s.parent_seq_id for s in samples} == {seq.seq_id}
    group, seqs = make_group(SamplingParams(n=2, best_of=5, temperature=1.0), outputs=(1,), num_seqs=5)
    (samples,) = Sampler(EOS)(rand_logits(5), [(group, seqs)])
    assert [s.parent_seq_id for s in samples] == [s.seq_id for s in seqs]


def test_beam_candidates_first_and_later_steps():
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0)
    logits = rand_logits(1, seed=4)
    group, (seq,) = make_group(params)
    (samples,) = Sampler(EOS)(logits, [(group, [seq])])
    assert [s.token_id for s in samples] == logits[0].topk(6).indices.tolist()
    assert {s.parent_seq_id for s in samples} == {seq.seq_id}

    group, seqs = make_group(params, outputs=(1,), num_seqs=3)
    for seq, cum in zip(seqs, (-0.1, -2.0, -0.5)):
        seq.cumulative_logprob = cum
    logits = rand_logits(3, seed=6)
    (samples,) = Sampler(EOS)(logits, [(group, seqs)])
    scores = torch.log_softmax(logits, -1) + torch.tensor([[-0.1], [-2.0], [-0.5]])
    ref = [(int(i) // VOCAB, int(i) % VOCAB) for i in scores.flatten().topk(6).indices]
    assert [(next(r for r, s in enumerate(seqs) if s.seq_id == x.parent_seq_id), x.token_id) for x in samples] == ref


def test_prompt_logprobs():
    logits = rand_logits(4, seed=8)
    prompt = [3, 17, 2, 40]
    out = compute_prompt_logprobs(logits, prompt, 2)
    ref = torch.log_softmax(logits, -1)
    assert out[0] is None and len(out) == 4
    for i in range(1, 4):
        assert out[i][prompt[i]] == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-6)
        assert set(ref[i - 1].topk(2).indices.tolist()) <= set(out[i])


def test_bad_words_mask_a_words_last_token_only_after_its_other_tokens():
    logits = torch.zeros(3, VOCAB)
    logits[:, 11], logits[:, 12], logits[:, 13] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[10, 11], [12]])
    groups = [make_group(params, outputs=(10,)), make_group(params, outputs=(5,)), make_group(params)]
    tokens = [samples[0].token_id for samples in Sampler(EOS)(logits, groups)]
    # After 10, the word [10, 11] would complete: 11 is masked, and 12 (a one-token word) always is.
    assert tokens == [13, 11, 11]


def test_allowed_token_ids_are_the_only_ones_sampled():
    logits = rand_logits(64, seed=3)
    groups = [make_group(SamplingParams(temperature=1.5, seed=i, allowed_token_ids=[3, 4, 40])) for i in range(64)]
    tokens = {samples[0].token_id for samples in Sampler(EOS)(logits, groups)}
    assert tokens <= {3, 4, 40} and len(tokens) > 1
