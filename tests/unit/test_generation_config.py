"""vLLM's --generation-config: which of a generation_config.json's values become sampling defaults."""
from __future__ import annotations

import json

import pytest

from engine.generation_config import generation_defaults
from engine.sampling_params import SamplingParams


def test_the_files_recommended_sampling_values_and_nothing_else(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0,
        "max_new_tokens": 256, "do_sample": True, "eos_token_id": [1, 2], "bos_token_id": 1}))
    defaults = generation_defaults(str(tmp_path))
    # repetition_penalty 1.0 is transformers' own default: nothing recommended (vLLM reads the diff as well)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_tokens": 256}
    assert SamplingParams(**defaults).top_k == 20
    assert generation_defaults(str(tmp_path), "vllm") == {}
    assert generation_defaults(None, str(tmp_path)) == defaults  # a folder named by the flag


def test_no_file_means_no_defaults_and_a_named_folder_must_hold_one(tmp_path):
    assert generation_defaults(str(tmp_path)) == {}
    assert generation_defaults(str(tmp_path / "model.gguf")) == {} and generation_defaults(None) == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(None, str(tmp_path))
    with pytest.raises(ValueError, match="is not a folder"):
        generation_defaults(None, str(tmp_path / "missing"))
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        generation_defaults(str(tmp_path))


@pytest.mark.parametrize("values, words", [({"temperature": 5.0}, "temperature must be in"),
                                           ({"top_k": 0}, "top_k must be"),
                                           ({"top_p": "high"}, "top_p must be a number")])
def test_a_value_no_request_could_run_with_fails_at_start(tmp_path, values, words):
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=words):
        generation_defaults(str(tmp_path))


def test_override_is_laid_over_the_file_or_alone(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    assert generation_defaults(str(tmp_path), override='{"temperature": 0.5, "max_new_tokens": 64}') == {
        "temperature": 0.5, "top_k": 20, "max_tokens": 64}
    assert generation_defaults(str(tmp_path), "vllm", {"top_p": 0.9}) == {"top_p": 0.9}
    for override, words in (('{"temprature": 0.5}', r"unknown key\(s\) \['temprature'\]"), ("0.5", "JSON object"),
                            ("{temperature", "not JSON"), ('{"temperature": 9}', "temperature must be in")):
        with pytest.raises(ValueError, match=words):
            generation_defaults(str(tmp_path), override=override)
