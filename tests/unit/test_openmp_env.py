"""`pagedserve serve` spins idle OpenMP workers briefly (engine/platform/openmp.py) unless the user chose a policy."""
from __future__ import annotations

import os

import pytest

from engine.platform.openmp import SERVING_OPENMP_ENV, apply_serving_default


def test_serving_default_applies_to_an_unset_environment(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    apply_serving_default()
    assert os.environ["GOMP_SPINCOUNT"] == SERVING_OPENMP_ENV["GOMP_SPINCOUNT"] == "4000"


@pytest.mark.parametrize("name, value", [("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "300000")])
def test_the_users_choice_wins(monkeypatch, name, value):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv(name, value)
    apply_serving_default()
    assert os.environ[name] == value
    assert ("GOMP_SPINCOUNT" in os.environ) == (name == "GOMP_SPINCOUNT")
