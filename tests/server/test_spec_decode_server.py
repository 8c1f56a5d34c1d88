"""--speculative-config through the server: vLLM's spec_decode counters on /metrics, streamed and plain answers the
same as without speculation, and bad configs refused at startup with a sentence (no traceback)."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from bad_inputs import MODEL
from serving_harness import metric

from engine.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = "one two three four one two three four one two three"
COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total")


@pytest.fixture(scope="module")
def spec_server(make_tiny_engine):
    """The tiny Llama served with n-gram speculation, verifying every proposal (spec.always)."""
    from server.app import create_app
    from serving_harness import ServerThread

    engine = make_tiny_engine(speculative_config=json.dumps(NGRAM))
    engine.engine.spec.always = True
    with ServerThread(create_app(engine)) as server:
        server.engine = engine
        yield server


def test_metrics_and_answers(spec_server, tiny_server):
    def scrape():
        text = httpx.get(spec_server.base_url + "/metrics").text
        return [metric(text, "pagedserve:" + name) for name in COUNTERS]

    before = scrape()
    answers = []
    for server in (tiny_server, spec_server):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0,
                                          extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert plain.usage.completion_tokens == 48
        answers.append((plain.choices[0].text, streamed))
    assert answers[0] == answers[1]
    drafts, draft_tokens, accepted = (a - b for a, b in zip(scrape(), before))
    stats = spec_server.engine.get_stats()
    assert 0 < drafts <= draft_tokens and 0 < accepted <= draft_tokens
    assert accepted == stats.spec_decode_num_accepted_tokens - before[2]


@pytest.mark.parametrize("bad, says", [
    ("{", "not valid JSON"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be"),
    ('{"method": "ngram"}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "exceeds"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs .model."),
])
def test_bad_configs_are_refused(bad, says):
    with pytest.raises(ValueError, match=says):
        SpeculativeConfig.parse(bad)


def test_cli_refuses_a_bad_config_at_startup():
    run = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 0}'], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert "pagedserve: error: speculative_config: num_speculative_tokens must be an integer" in run.stderr
    assert "Traceback" not in run.stderr


def test_cli_flag_reaches_the_config():
    from server.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(NGRAM)])
    assert config_from_args(args).speculative_config == SpeculativeConfig("ngram", 3, 3, 1)
