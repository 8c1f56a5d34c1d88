"""Fixtures of the reliability suite (helpers live in reliability_harness.py; the tiny model in tests/conftest.py)."""
from __future__ import annotations

import pytest

import reliability_harness  # noqa: F401  (puts tests/server on the path for serving_harness)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # 2 shared cores: OpenMP threads of the step spin against the event loop and the test's own clients.
    import torch

    torch.set_num_threads(1)
