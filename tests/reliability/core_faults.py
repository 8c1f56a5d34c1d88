"""Faults that a request asks for by its request_id: the fault injector of the reliability tests, set on the engine in
the test process, or in an engine core process through the core's test hook
(PAGEDSERVE_CORE_FAULT_INJECTOR=core_faults:by_request_id, engine/core_proc.py), where no test can reach the engine.

A request whose request_id holds "fault-<stage>-<n>" raises at the n-th call of `stage` (engine/faults.py: a step's
stages, or "admission") that names it, once: RuntimeError("injected fault at <stage>"), KeyError at admission.
"fault-<stage>-<n>x<k>" raises at the next k - 1 calls of that stage too, whatever they name (a fault that recurs).
A suffix "s<ms>" makes each of its faults take that many milliseconds first (a step longer than the poll of the
engine core's client). "fault-lose-<n>": at the n-th schedule that names it the request is taken off the waiting
queue and the schedule raises (half a schedule: no queue holds it, and no fault names it). "bad-input": admission
raises GrammarError, a ValueError: the request's own bad input, which the client gets as a 400.
Each fault is written as a line "<stage> <request id>" to the file $CORE_FAULTS_LOG names (when set), for a test to
see that it fired in whichever process it ran.
"""
from __future__ import annotations

import os
import re
import time
from collections import Counter
from typing import Any, Callable

HOOK = "core_faults:by_request_id"  # the value of engine/core_proc.py's FAULT_INJECTOR_ENV
LOG_ENV = "CORE_FAULTS_LOG"
_PLAN = re.compile(r"fault-([a-z_]+)-(\d+)(?:x(\d+))?(?:s(\d+))?")


def by_request_id(engine: Any = None) -> Callable[[str, list[str]], None]:
    calls: Counter = Counter()
    fired: set[str] = set()
    again: Counter = Counter()  # stage -> faults still to come, whatever the requests
    slow: dict[str, float] = {}  # stage -> seconds each of its faults takes first

    def inject(stage: str, request_ids: list[str]) -> None:
        victim = None
        if again[stage] > 0:
            again[stage] -= 1
            victim = "(recurring)"
        for request_id in request_ids if victim is None else ():
            if stage == "admission" and "bad-input" in request_id:
                _log(stage, request_id)
                from engine.structured_output.grammars import GrammarError

                raise GrammarError("injected bad input")
            plan = _PLAN.search(request_id)
            lose = plan is not None and plan[1] == "lose" and stage == "schedule"
            if plan is None or (plan[1] != stage and not lose) or request_id in fired:
                continue
            calls[request_id] += 1
            if calls[request_id] == int(plan[2]):
                fired.add(request_id)
                again[stage] = int(plan[3] or 1) - 1
                slow[stage] = int(plan[4] or 0) / 1000
                victim = request_id
                if lose:
                    waiting = engine.scheduler.waiting
                    waiting.remove(next(g for g in waiting if g.request_id == request_id))
                break
        if victim is None:
            return
        _log(stage, victim)
        time.sleep(slow.get(stage, 0.0))
        raise (KeyError if stage == "admission" else RuntimeError)(f"injected fault at {stage}")

    return inject


def _log(stage: str, request_id: str) -> None:
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{stage} {request_id}\n")


def fired(log_path: os.PathLike) -> list[tuple[str, str]]:
    """(stage, request id) of every fault written to the log so far."""
    try:
        with open(log_path) as f:
            return [tuple(line.split()) for line in f if line.strip()]  # type: ignore[misc]
    except FileNotFoundError:
        return []
