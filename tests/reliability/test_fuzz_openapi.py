"""schemathesis drives openapi.yaml against a live server: never a 5xx, never a response the schema does not allow."""
from __future__ import annotations

from collections import Counter

import httpx
import pytest

from reliability_harness import ROOT, leaked_blocks, record, serve, wait_engine_idle

schemathesis = pytest.importorskip("schemathesis")  # in the dev extra
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance, not_a_server_error, response_schema_conformance, status_code_conformance,
)

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
MAX_TOKENS = 4  # generated bodies ask for anything; the fuzz is about shapes, not long generations
# (method, path) -> examples per mode: the generation endpoints get most of the ~60 s.
BUDGET = {("POST", "/v1/completions"): 200, ("POST", "/v1/chat/completions"): 120, ("POST", "/tokenize"): 40,
          ("POST", "/detokenize"): 40, ("GET", "/v1/models"): 3, ("GET", "/health"): 3, ("GET", "/version"): 3,
          ("GET", "/metrics"): 3, ("POST", "/v1/responses"): 50, ("GET", "/v1/responses/{response_id}"): 5,
          ("DELETE", "/v1/responses/{response_id}"): 5, ("POST", "/v1/responses/{response_id}/cancel"): 5}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with serve(tiny_llama_dir, max_model_len=64, max_num_seqs=16, num_gpu_blocks_override=128) as s:
        yield s


@pytest.fixture(scope="module")
def schema():
    return schemathesis.openapi.from_path(ROOT / "openapi.yaml")


def _bounded(case) -> None:
    """Keep generation short: cap max_tokens (and chat's max_completion_tokens) of a well-formed body."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS


def _operations(schema) -> list:
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in ops} == set(BUDGET), "openapi.yaml routes changed: update BUDGET"
    return ops


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzz_every_operation(server, schema, mode):
    statuses: Counter = Counter()
    for op in _operations(schema):
        if mode is GenerationMode.NEGATIVE and (op.method.upper() in ("GET", "DELETE") or op.path.endswith("/cancel")):
            continue  # no body, at most a free-form string id in the path: nothing to make invalid
        examples = BUDGET[(op.method.upper(), op.path)]

        @settings(max_examples=examples if mode is GenerationMode.POSITIVE else max(3, examples // 2),
                  deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def fuzz(case):
            _bounded(case)
            response = case.call(base_url=server.base_url, timeout=60)
            statuses[response.status_code] += 1
            case.validate_response(response, checks=CHECKS)

        fuzz()
    wait_engine_idle(server)
    leaks = leaked_blocks(server)
    record(f"fuzz_{mode.value}", {"requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
                                  "5xx": sum(v for k, v in statuses.items() if k >= 500),
                                  "schemathesis": schemathesis.SCHEMATHESIS_VERSION,
                                  "blocks_leaked": sum(leaks.values())})
    assert not [k for k in statuses if k >= 500], statuses
    assert leaks == {"device_blocks": 0, "cpu_blocks": 0, "block_tables": 0}
    assert httpx.get(server.base_url + "/health").status_code == 200
    if mode is GenerationMode.POSITIVE:
        assert statuses[200] > 20, statuses  # the fuzz reached the engine, not only the validators

