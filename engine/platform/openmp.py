"""How long libgomp's idle OpenMP workers spin before they sleep, for a serving process.

A decode step opens ~150 OpenMP parallel regions (one per kernel), with microseconds of Python between them. A
worker that sleeps at once (OMP_WAIT_POLICY=PASSIVE) pays a wake-up at each region; one that spins long
(GOMP_SPINCOUNT=300000, ~3 ms, libgomp's default without a policy) keeps its core busy after the step too, while
the event loop or another process needs it. GOMP_SPINCOUNT=4000 spins across the gaps inside a step and sleeps
between steps. Measured (docs/benchmarks.md, "OpenMP threads"), Intel Xeon, 2 cores, bfloat16 decode step at batch
1: PASSIVE 28.6 ms, 2000 25.1, 4000 18.2, 10000 18.1, 300000 17.6; two servers sharing the cores at 8 streams
each: PASSIVE 94 + 95 tok/s, 4000 75 + 74, 10000 59 + 59, 300000 16.5 + 16.6.

libgomp reads these once, when torch loads it: call apply_serving_default() before torch is imported. An
OMP_WAIT_POLICY or GOMP_SPINCOUNT already in the environment wins. Importing the engine sets nothing.
"""
from __future__ import annotations

import os

SERVING_OPENMP_ENV = {"GOMP_SPINCOUNT": "4000"}


def apply_serving_default() -> None:
    """Set SERVING_OPENMP_ENV unless the environment already chose a wait policy or a spin count."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ.update(SERVING_OPENMP_ENV)
