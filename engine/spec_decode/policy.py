"""When speculation pays: a running model of a step's cost against its rows, and each sequence's acceptance.

A CPU decode step at a few rows reads every weight once whatever the rows (memory-bound): k more rows cost little
and each accepted token is a step saved. As rows grow the step turns compute-bound and extra rows cost their
share. So the engine fits step time = a + b * rows from the steps it runs (decode-only ones: a prefill's tokens
cost differently), and speculates with the sequences whose expected accepted tokens buy more than the rows cost:

    (R + sum E_i) / T(R + sum k_i)  >  R / T(R)        (tokens per second, with and without)

E_i = alpha + alpha^2 + ... + alpha^k_i for a sequence accepting each proposed token with probability alpha.

A step that verifies proposals costs more than its rows say: it takes the general path (every row's logits, the
per-group sampler and output processing, no steady decode), and the step after it rebuilds the steady decode. That
excess over the plain line is measured too (Overhead) and added to T(R + sum k_i). Like a sequence's acceptance it
drifts back to nothing while the engine does not speculate, so a cold first step (new shapes) or a busy spell
does not switch speculation off for good.

A draft model differs from a lookup in two ways, both measured. Its forwards cost real time every step it proposes,
whatever the load (DraftCost: not forgotten while idle, it is the draft's size). And its acceptance is a property of
the draft more than of the text: a new sequence starts from what the draft achieved for the sequences before it
(Pool), so a draft that pays for nobody is not probed again by every request. A lookup's acceptance depends on each
text (a summary copies, a story does not): there every sequence starts from the fixed prior.
"""
from __future__ import annotations

from typing import Optional

# Prior slope: a row costs 1/PRIOR_ROWS of a step's fixed part, until the steps measured say otherwise (SmolLM2
# bfloat16 on a 2-vCPU Xeon: 1 row ~14 ms, 32 rows ~40 ms, i.e. ~1/17; a cost guessed high errs towards not
# speculating). PRIOR_WEIGHT: how many rows^2 of spread the prior slope counts as.
PRIOR_ROWS = 16.0
PRIOR_WEIGHT = 64.0
DECAY = 0.99  # per observed step: the fit follows a change of load within a few hundred steps
# A sequence's acceptance starts (and drifts back, while it does not speculate) at PRIOR_ALPHA with PRIOR_TRIALS
# pseudo-trials; each step it does not speculate its own trials decay by IDLE_DECAY, so one that stopped paying
# is tried again after some tens of steps (a probe: a few rows at the cheap end of the curve).
PRIOR_ALPHA = 0.6
PRIOR_TRIALS = 2.0
IDLE_DECAY = 0.95
# The draft model's acceptance over every sequence (Pool): a new sequence's prior and where an idle one drifts
# back to. POOL_DECAY a verification (it follows the last ~100), POOL_IDLE a step none speculates (halfway back to
# PRIOR_ALPHA in ~350 steps, so a draft that did not pay is tried again, rarely).
POOL_DECAY = 0.99
POOL_IDLE = 0.998
# A speculating step's measured excess counts at most this many plain steps (a cold first step compiles shapes).
MAX_EXCESS_STEPS = 2.0
MARGIN = 1.03  # the gain speculation must promise: timing noise on shared cores, and Python a row costs


class StepCost:
    """Least squares of step seconds on rows with exponential forgetting, the slope held towards a prior."""

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = DECAY
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + rows
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + rows * rows
        self.sxy = d * self.sxy + rows * seconds

    def line(self) -> Optional[tuple[float, float]]:
        """(a, b): seconds = a + b * rows; None before any step was measured."""
        if self.n == 0.0:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = max(self.sxx / self.n - mx * mx, 0.0)
        cov = self.sxy / self.n - mx * my
        b0 = my / (mx + PRIOR_ROWS)
        b = max((self.n * cov + PRIOR_WEIGHT * b0) / (self.n * var + PRIOR_WEIGHT), 0.0)
        a = max(my - b * mx, 1e-6)
        return a, b

    def seconds(self, rows: int) -> Optional[float]:
        line = self.line()
        return None if line is None else line[0] + line[1] * rows

    def ratio(self, rows: int, extra: int, overhead: float = 0.0) -> float:
        """(T(rows + extra) + overhead seconds) / T(rows)."""
        line = self.line()
        if line is None:
            return 1.0 + extra / (rows + PRIOR_ROWS)
        a, b = line
        return (a + b * (rows + extra) + overhead) / (a + b * rows)


class Overhead:
    """The seconds a speculating step (with the plain step after it) took beyond the plain line at its rows: a
    decaying mean over PRIOR_TRIALS pseudo-steps of none, forgotten by IDLE_DECAY a step while none speculates."""

    def __init__(self) -> None:
        self.total = self.steps = 0.0

    def seconds(self) -> float:
        return self.total / (self.steps + PRIOR_TRIALS)

    def observe(self, excess: float, plain: float) -> None:
        # (negative: the rows cost less than the line extrapolated to them)
        self.total = DECAY * self.total + min(max(excess, -plain), MAX_EXCESS_STEPS * plain)
        self.steps = DECAY * self.steps + 1.0

    def idle(self) -> None:
        self.total *= IDLE_DECAY
        self.steps *= IDLE_DECAY


class Acceptance:
    """One sequence's record: how often a proposed token was accepted (trials: tokens looked at)."""

    __slots__ = ("hits", "trials", "last_step", "index")

    def __init__(self) -> None:
        self.hits = self.trials = 0.0
        self.last_step = 0
        self.index = None  # the proposer's per-sequence state (engine/spec_decode/ngram.py NgramIndex)

    def alpha(self, prior: float = PRIOR_ALPHA) -> float:
        return (self.hits + prior * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS)

    def record(self, proposed: int, accepted: int) -> None:
        self.hits += accepted
        self.trials += accepted + (accepted < proposed)

    def idle(self) -> None:
        self.hits *= IDLE_DECAY
        self.trials *= IDLE_DECAY


class Pool(Acceptance):
    """A draft model's verifications over every sequence, forgotten slowly (POOL_DECAY) and, while none
    speculates, back towards PRIOR_ALPHA (POOL_IDLE): the prior of each sequence's own record."""

    def record(self, proposed: int, accepted: int) -> None:
        self.hits = POOL_DECAY * self.hits + accepted
        self.trials = POOL_DECAY * self.trials + accepted + (accepted < proposed)

    def idle(self) -> None:
        self.hits *= POOL_IDLE
        self.trials *= POOL_IDLE


class DraftCost:
    """Seconds the draft model's forwards take a step it proposes: a fixed part and one a proposing sequence (a
    few rows is memory-bound like the target's step), each a decaying mean. 0 before the draft first ran."""

    def __init__(self) -> None:
        self.cost = StepCost()

    def observe(self, sequences: int, seconds: float) -> None:
        self.cost.observe(sequences, seconds)

    def seconds(self, sequences: int) -> float:
        measured = self.cost.seconds(sequences)
        return 0.0 if measured is None else measured


def expected_accepted(alpha: float, k: int) -> float:
    """alpha + alpha^2 + ... + alpha^k: tokens accepted in a row, each with probability alpha."""
    return alpha * (1.0 - alpha ** k) / (1.0 - alpha) if alpha < 1.0 else float(k)


def choose(rows: int, candidates: list[tuple[float, int]], cost: StepCost, overhead: float = 0.0,
           draft: Optional[DraftCost] = None) -> int:
    """How many of the candidates (alpha, k), best alpha first, speculate: the count with the best tokens per
    second, 0 when none beats not speculating by MARGIN. overhead: a speculating step's seconds beyond its rows';
    draft: what the draft model's forwards for that many sequences would add (None: nothing, or already spent)."""
    best, best_gain = 0, MARGIN
    tokens, extra = float(rows), 0
    for count, (alpha, k) in enumerate(candidates, 1):
        tokens += expected_accepted(alpha, k)
        extra += k
        spent = overhead + (draft.seconds(count) if draft is not None else 0.0)
        gain = (tokens / rows) / cost.ratio(rows, extra, spent)
        if gain > best_gain:
            best, best_gain = count, gain
    return best
