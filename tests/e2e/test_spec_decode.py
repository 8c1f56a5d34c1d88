"""Speculative decoding (engine/spec_decode/): the same greedy tokens as without it, whatever the proposals and
whatever else the engine does (eager and compiled steps, preemption, prefix caching, chunked prefill, stop strings,
max_tokens, logprobs, n > 1, structured outputs, aborts); sampled outputs keep their distribution; every block back.

The cost model would not speculate on a loaded 2-core CI box where it does not pay: these engines set
`spec.always`, so every proposal is verified and the acceptance path runs."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from e2e_helpers import assert_all_blocks_free, greedy, token_ids
from engine.sampling_params import GuidedSpec, SamplingParams

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
LONG = dict(max_model_len=160)
ROOT = Path(__file__).resolve().parents[2]
TOKENS = 40


def _spec_llm(make_llm, which="tiny", spec=NGRAM, **kw):
    llm = make_llm(which, speculative_config=spec, **LONG, **kw)
    llm.engine.spec.always = True
    return llm


def _run(llm, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(make_llm, prompt_ids):
    """Greedy tokens without speculation: what every speculating engine must give."""
    return token_ids(_run(make_llm("tiny", **LONG), prompt_ids, greedy(TOKENS, ignore_eos=True)))


def _accepted(llm) -> int:
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts
    return stats.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("eager", [False, True], ids=["compiled", "eager"])
def test_ngram_greedy_identical(make_llm, prompt_ids, reference, eager):
    llm = _spec_llm(make_llm, enforce_eager=eager)
    before = _accepted(llm) if llm.engine.spec.num_drafts else 0
    assert token_ids(_run(llm, prompt_ids, greedy(TOKENS, ignore_eos=True))) == reference
    assert _accepted(llm) > before, "no proposal was ever accepted: the acceptance path did not run"


def test_draft_model_self_accepts_everything(make_llm, tiny_llama_dir, prompt_ids, reference):
    spec = json.dumps({"model": str(tiny_llama_dir), "num_speculative_tokens": 4})
    llm = _spec_llm(make_llm, spec=spec)
    assert token_ids(_run(llm, prompt_ids, greedy(TOKENS, ignore_eos=True))) == reference
    stats = llm.engine.get_stats()
    # The target as its own draft proposes exactly its own greedy tokens (k = 4, or fewer near max_tokens).
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert not llm.engine.spec.draft.seqs, "the draft's cache still holds finished sequences"
    assert llm.engine.spec.draft.allocator.num_free() == llm.engine.spec.draft.allocator.num_blocks


def test_layer_skipping_draft_identical(make_llm, tiny_llama_dir, prompt_ids, reference):
    spec = json.dumps({"model": str(tiny_llama_dir), "num_speculative_tokens": 3, "draft_num_layers": 1})
    llm = _spec_llm(make_llm, spec=spec)
    assert token_ids(_run(llm, prompt_ids, greedy(TOKENS, ignore_eos=True))) == reference
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens  # a real, imperfect draft


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(make_llm, prompt_ids, reference, mode):
    # Room for about two sequences at full length: the batch preempts, and the proposals' blocks compete too.
    llm = _spec_llm(make_llm, num_gpu_blocks_override=2 * 10 + 1, preemption_mode=mode)
    stats = llm.engine.get_stats()
    before = stats.num_preemptions_recompute + stats.num_preemptions_swap
    assert token_ids(_run(llm, prompt_ids, greedy(TOKENS, ignore_eos=True))) == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > before


@pytest.mark.parametrize("options", [dict(enable_prefix_caching=True), dict(enable_chunked_prefill=True,
                                                                            max_num_batched_tokens=32, max_num_seqs=16)],
                         ids=["prefix-caching", "chunked-prefill"])
def test_prefix_caching_and_chunked_prefill(make_llm, prompt_ids, reference, options):
    llm = _spec_llm(make_llm, **options)
    for _ in range(2):  # the second pass hits the blocks the first one (with proposals in them) registered
        assert token_ids(_run(llm, prompt_ids, greedy(TOKENS, ignore_eos=True))) == reference


def test_max_tokens_stop_strings_and_logprobs(make_llm, prompt_ids):
    plain, spec = make_llm("tiny", **LONG), _spec_llm(make_llm)
    for params in (greedy(7, ignore_eos=True), greedy(TOKENS, ignore_eos=True, logprobs=2)):
        a, b = _run(plain, prompt_ids, params), _run(spec, prompt_ids, params)
        assert token_ids(a) == token_ids(b)
        assert all(len(c.token_ids) == params.max_tokens for out in b for c in out.outputs)  # never overshoots
        for x, y in zip(a, b):
            if params.logprobs:
                for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                    assert lx.keys() == ly.keys()
                    assert all(abs(lx[t] - ly[t]) < 1e-3 for t in lx)
    # Stop strings: cut a text the plain engine produced at a word in its middle.
    texts = [o.outputs[0].text for o in _run(plain, prompt_ids, greedy(TOKENS, ignore_eos=True))]
    stops = [t[len(t) // 2: len(t) // 2 + 3] or "zz" for t in texts]
    for ids, stop in zip(prompt_ids, stops):
        params = greedy(TOKENS, ignore_eos=True, stop=[stop])
        x, y = _run(plain, [ids], params)[0].outputs[0], _run(spec, [ids], params)[0].outputs[0]
        assert (x.text, x.token_ids, x.finish_reason, x.stop_reason) == (y.text, y.token_ids, y.finish_reason,
                                                                          y.stop_reason)


def test_n_greater_than_one_and_abort(make_llm, prompt_ids):
    plain, spec = make_llm("tiny", **LONG), _spec_llm(make_llm)
    # top_k 1: sampled rows (the sampler's general path, n sequences a group) whose tokens are still determined.
    params = SamplingParams(n=3, temperature=0.8, top_k=1, max_tokens=TOKENS, ignore_eos=True)
    assert token_ids(_run(plain, prompt_ids, params)) == token_ids(_run(spec, prompt_ids, params))
    seeded = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=TOKENS, ignore_eos=True)
    assert all(len(c) == TOKENS for req in token_ids(_run(spec, prompt_ids, seeded)) for c in req)
    engine = spec.engine
    drafts = engine.spec.num_drafts
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"abort-{i}", prompt_token_ids=ids, params=greedy(TOKENS, ignore_eos=True))
    while engine.spec.num_drafts == drafts:
        engine.step()
    engine.abort_request([f"abort-{i}" for i in range(len(prompt_ids))])
    assert_all_blocks_free(engine)


def test_structured_output(make_llm, prompt_ids):
    plain, spec = make_llm("tiny", **LONG), _spec_llm(make_llm)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, guided=GuidedSpec("regex", "(ab|cd){3,30}"))
    accepted = spec.engine.spec.num_accepted_tokens
    a, b = _run(plain, prompt_ids[:3], params), _run(spec, prompt_ids[:3], params)
    assert token_ids(a) == token_ids(b)
    assert spec.engine.spec.num_accepted_tokens > accepted  # proposals the grammar allowed were verified
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in b)


def test_sampling_keeps_the_distribution(make_llm, tiny_llama_dir, prompt_ids):
    """Rejection sampling of point-mass proposals: the tokens drawn with speculation follow the same distribution
    as without. The target is its own draft, whose proposals are its greedy tokens: at temperature 1 over the top
    3 each is right with the probability of the most likely token, often and not always. 600 seeded requests,
    the first 3 tokens of each compared. The bound is generous: between two 600-draw empirical distributions of a
    few dozen outcomes the total variation is ~0.1-0.15 by chance; a verifier that accepted its proposals regardless
    gave 0.68 (checked by hand when this test was written). (This verifier draws each position's one uniform from
    the request's generator in the order a plain step does, so here the seeded outputs even come out the same.)"""
    spec_config = json.dumps({"model": str(tiny_llama_dir), "num_speculative_tokens": 3})
    plain, spec = make_llm("tiny", **LONG), _spec_llm(make_llm, spec=spec_config)
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, seed=s, ignore_eos=True) for s in range(600)]
    drafts, accepted = spec.engine.spec.num_draft_tokens, spec.engine.spec.num_accepted_tokens
    dist = []
    for llm in (plain, spec):
        outs = llm.generate(prompt_token_ids=[prompt_ids[2]] * len(params), sampling_params=params, use_tqdm=False)
        dist.append(Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs))
    tv = 0.5 * sum(abs(dist[0][key] - dist[1][key]) for key in set(dist[0]) | set(dist[1])) / len(params)
    new_drafts = spec.engine.spec.num_draft_tokens - drafts
    new_accepted = spec.engine.spec.num_accepted_tokens - accepted
    assert new_drafts > 300 and 0.1 * new_drafts < new_accepted < 0.9 * new_drafts, (new_drafts, new_accepted)
    assert tv < 0.2, (tv, dist)


def test_the_benchmark_prompts_come_out_identical_on_the_default_model(make_llm, smol_tokenizer):
    """benchmarks/spec_decode.py's prompts as it runs them (SmolLM2 in bfloat16): its six input-grounded tasks
    (the chat template around 300-800 tokens of text or code) and four of its free-prose prompts, all in one
    batch: the greedy tokens with n-gram speculation, every proposal verified, are the plain ones. (The first 32
    tokens of each: the benchmark checks its 256 on every run. One engine, speculation off then on, the prompts'
    blocks from the prefix cache the second time: the prefills are most of the cost.)"""
    import argparse
    import random
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serving import make_requests

    tasks = json.loads((ROOT / "benchmarks/data/spec_decode_tasks.json").read_text())["tasks"]
    texts = [smol_tokenizer.apply_chat_template([{"role": "user", "content": f"{t['instruction']}\n\n{t['text']}"}],
                                                add_generation_prompt=True, tokenize=False) for t in tasks]
    prompts = [smol_tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    ns = argparse.Namespace(num_prompts=4, input_len=128, output_len=32, input_len_range=0.0, output_len_range=0.0,
                            prompt_kind="tokens", token_id_low=1000, token_id_high=10000)
    prompts += [list(p) for p, _, _ in make_requests(ns, random.Random(0))]
    llm = make_llm("smol", dtype="bfloat16", max_model_len=1024, enable_prefix_caching=True, speculative_config=(
        json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})))
    params = SamplingParams(temperature=0.0, max_tokens=32)
    spec, llm.engine.spec = llm.engine.spec, None  # plain decoding first; its prompts' blocks stay cached
    try:
        plain = token_ids(_run(llm, prompts, params))
    finally:
        llm.engine.spec = spec
    spec.always = True
    accepted = spec.num_accepted_tokens
    assert token_ids(_run(llm, prompts, params)) == plain
    assert spec.num_accepted_tokens - accepted > 32  # the proposals were verified, many taken
