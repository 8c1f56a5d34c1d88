"""The compiled-grammar cache holds its one bound in bytes, however many distinct schemas clients send."""
from __future__ import annotations

import json

import pytest

from engine.sampling_params import GuidedSpec
from engine.structured_output.grammars import StructuredOutputs

LIMIT = 1 << 20  # 1 MiB; a small object schema compiles to ~40 KiB with SmolLM2's vocabulary


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def schema(i: int) -> GuidedSpec:
    return GuidedSpec.json_schema({"type": "object", "properties": {f"field_{i}_{j}": {"type": "string"}
                                                                    for j in range(4)}, "required": [f"field_{i}_0"]})


def test_many_distinct_schemas_stay_within_the_bound(tokenizer):
    structured = StructuredOutputs(tokenizer, 49152, tokenizer.eos_token_id, cache_bytes=LIMIT)
    compiled = [structured.compile(schema(i)) for i in range(80)]
    held = sum(g.memory_size_bytes for g in compiled)
    assert held > 2 * LIMIT, "the schemas are too small to test the bound"
    # xgrammar's own cache (unbounded by default) holds nothing: ours is the one cache.
    assert structured._compiler.get_cache_size_bytes() <= LIMIT
    assert structured.cache_bytes <= LIMIT and 0 < len(structured) < 80
    assert structured.cached(schema(79)) is not None and structured.cached(schema(0)) is None  # LRU order
    again = structured.compile(schema(0))  # dropped, so compiled anew: the same grammar
    assert again.memory_size_bytes == compiled[0].memory_size_bytes and structured.cached(schema(0)) is not None
    assert structured.cache_bytes <= LIMIT


def test_a_grammar_over_the_whole_bound_is_served_but_not_kept(tokenizer):
    structured = StructuredOutputs(tokenizer, 49152, tokenizer.eos_token_id, cache_bytes=16 << 10)
    grammar = structured.compile(schema(1))
    assert grammar.memory_size_bytes > 16 << 10
    state = structured.new_state(grammar)
    assert not state.is_terminated()
    assert len(structured) == 0 and structured.cache_bytes == 0


def test_the_bound_comes_from_the_engine_config(make_llm):
    engine = make_llm("tiny", grammar_cache_mb=0.5).engine
    assert engine.structured.cache_limit_bytes == 1 << 19
