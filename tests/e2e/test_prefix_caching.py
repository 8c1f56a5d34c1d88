"""Prefix caching: prompts sharing a long prefix reuse its blocks, and the outputs stay those of caching off."""
from __future__ import annotations

from e2e_helpers import greedy, seeded_pair, token_ids

PREFIX = (
    "You are a helpful assistant. Answer briefly and precisely, in plain English, without lists. "
    "Here is the question of the user, read it carefully before you answer it:"
)
QUESTIONS = [" Why is the sky blue?", " What is a prime number?", " Who wrote Hamlet?", " How do bees make honey?"]


def test_shared_prefixes_hit_the_cache_and_keep_outputs(make_llm, smol_tokenizer):
    prompts = [smol_tokenizer(PREFIX + q).input_ids for q in QUESTIONS]
    assert min(len(p) for p in prompts) > 2 * 16, "the shared prefix spans at least two full blocks"
    runs = [greedy(ignore_eos=True), seeded_pair(ignore_eos=True)]

    def generate(llm, params):
        # The first prompt runs alone, so its computed blocks are in the cache when the others arrive.
        first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)
        return token_ids(first + llm.generate(prompt_token_ids=prompts[1:], sampling_params=params, use_tqdm=False))

    plain, cached = make_llm("tiny"), make_llm("tiny", enable_prefix_caching=True)
    for params in runs:
        assert generate(cached, params) == generate(plain, params)
    assert cached.engine.get_stats().prefix_cache_hit_rate > 0
    assert plain.engine.get_stats().prefix_cache_hit_rate == 0
