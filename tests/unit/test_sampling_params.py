"""SamplingParams: every validation rule raises a ValueError that starts with the field name; edge values pass."""
import pytest

from engine.sampling_params import SamplingParams

INVALID = [
    ("n", dict(n=0)),
    ("n", dict(n=1.5)),
    ("best_of", dict(n=3, best_of=2)),
    ("best_of", dict(best_of=2.0)),
    ("presence_penalty", dict(presence_penalty=2.01)),
    ("presence_penalty", dict(presence_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-3.0)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=2.01)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=2.01)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.01)),
    ("top_k", dict(top_k=0)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.5)),
    ("min_p", dict(min_p=-0.01)),
    ("min_p", dict(min_p=1.01)),
    ("seed", dict(seed="7")),
    ("max_tokens", dict(max_tokens=0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17, max_tokens=16)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=6, max_logprobs=5)),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("stop", dict(stop="")),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=[3])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=["2"])),
    ("logit_bias", dict(logit_bias={5: 100.5})),
    ("logit_bias", dict(logit_bias={5: -101})),
    ("best_of", dict(use_beam_search=True, temperature=0.0, best_of=1)),
    ("temperature", dict(use_beam_search=True, temperature=0.5, best_of=2)),
    ("top_p", dict(use_beam_search=True, temperature=0.0, best_of=2, top_p=0.9)),
    ("top_p", dict(use_beam_search=True, temperature=0.0, best_of=2, top_k=5)),
    ("top_p", dict(use_beam_search=True, temperature=0.0, best_of=2, min_p=0.1)),
    ("early_stopping", dict(use_beam_search=True, temperature=0.0, best_of=2, early_stopping="sometimes")),
    ("best_of", dict(temperature=0.0, best_of=2)),
]


@pytest.mark.parametrize("field,kwargs", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_values_name_the_field(field, kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(field + " "), message
    assert len(message) > len(field) + 5  # a sentence, not just the name


EDGES = [
    dict(n=1, best_of=1),
    dict(n=2, best_of=2),
    dict(n=2, best_of=5),
    dict(presence_penalty=2.0, frequency_penalty=-2.0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(repetition_penalty=2.0),
    dict(repetition_penalty=1e-3),
    dict(temperature=0.0),
    dict(temperature=2.0),
    dict(top_p=1.0),
    dict(top_p=1e-3),
    dict(top_k=-1),
    dict(top_k=1),
    dict(min_p=0.0),
    dict(min_p=1.0),
    dict(seed=0),
    dict(seed=-5),
    dict(max_tokens=1),
    dict(max_tokens=None, min_tokens=1000),
    dict(min_tokens=16, max_tokens=16),
    dict(logprobs=0, prompt_logprobs=0),
    dict(logprobs=20, prompt_logprobs=20),
    dict(logprobs=5, max_logprobs=5),
    dict(stop_token_ids=[0]),
    dict(logit_bias={0: 100, 1: -100}),
    dict(use_beam_search=True, temperature=0.0, best_of=2, early_stopping="never"),
    dict(use_beam_search=True, temperature=0.0, n=2, best_of=2, early_stopping=True),
]


@pytest.mark.parametrize("kwargs", EDGES, ids=[str(i) for i in range(len(EDGES))])
def test_edge_values_pass(kwargs):
    SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    params = SamplingParams(n=3, stop="END", stop_token_ids=None, logit_bias={"7": "1.5"})
    assert params.best_of == 3
    assert params.stop == ["END"] and params.stop_token_ids == []
    assert params.logit_bias == {7: 1.5}
    assert not params.greedy
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2)
    # Greedy ignores the sampling knobs, so they are reset rather than rejected.
    assert greedy.greedy and (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    beam = SamplingParams(use_beam_search=True, temperature=0.0, best_of=3)
    assert not beam.greedy and beam.best_of == 3


@pytest.mark.parametrize("words", [[""], ["  "], [3], ["ok", None]])
def test_bad_words_must_be_words(words):
    with pytest.raises(ValueError, match="bad_words must be non-empty strings"):
        SamplingParams(bad_words=words)
