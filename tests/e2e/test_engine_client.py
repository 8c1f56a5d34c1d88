"""The engine's layers: LLMEngine is an EngineCore and AsyncLLMEngine an EngineClient (engine/frontend/protocol.py);
AsyncLLMEngine.shutdown reads no engine state while a step runs in the executor thread."""
from __future__ import annotations

import asyncio
import threading
import time

import inspect

from engine.frontend.async_engine import AsyncLLMEngine
from engine.frontend.protocol import EngineClient, EngineCore
from engine.sampling_params import SamplingParams


def _signatures_match(protocol, obj) -> list[str]:
    """Members whose parameters differ from the protocol's (isinstance checks only that they exist)."""
    out = []
    for name, member in vars(protocol).items():
        if callable(member) and not name.startswith("_"):
            want = list(inspect.signature(member).parameters)
            have = ["self"] + list(inspect.signature(getattr(obj, name)).parameters)
            if want != have:
                out.append(f"{name}: {have} != {want}")
    return out


def test_the_engines_are_what_the_layers_above_expect(make_llm):
    engine = make_llm("tiny").engine
    front = AsyncLLMEngine(engine, log_stats=False)
    assert isinstance(engine, EngineCore) and isinstance(front, EngineClient)
    assert _signatures_match(EngineCore, engine) == [] and _signatures_match(EngineClient, front) == []


class ExclusiveEngine:
    """The real LLMEngine, recording every call that reaches it while one of its steps is running."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._stepping = threading.Event()
        self.overlapping_calls: list[str] = []

    def step(self):
        self._stepping.set()
        try:
            return self._engine.step()
        finally:
            self._stepping.clear()

    def __getattr__(self, name):
        attr = getattr(self._engine, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self._stepping.is_set():
                self.overlapping_calls.append(name)
            return attr(*args, **kwargs)
        return call


def test_shutdown_waits_for_the_loop_instead_of_reading_the_engine_mid_step(make_llm):
    engine = make_llm("tiny", max_num_seqs=3).engine
    # Once shutdown begins, steps are slow: nearly all the time is spent inside one, so a read of the engine
    # from the event loop would overlap it.
    shutting_down = threading.Event()
    engine.fault_injector = (lambda stage, request_ids:
                             time.sleep(0.2 if shutting_down.is_set() else 0.005) if stage == "sampler" else None)
    checked = ExclusiveEngine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def scenario():
        front = AsyncLLMEngine(checked, log_stats=False)
        outputs = []

        async def consume(request_id):
            try:
                async for out in front.generate(request_id, prompt_token_ids=[1, 2, 3], params=params):
                    outputs.append(out)
            except Exception as exc:  # the shutdown cut ends it
                outputs.append(exc)

        readers = [asyncio.create_task(consume(f"r{i}")) for i in range(2)]
        while len(outputs) < 4:
            await asyncio.sleep(0.01)
        shutting_down.set()
        await front.shutdown(timeout_s=0.3)
        await asyncio.gather(*readers)
        return outputs

    try:
        outputs = asyncio.run(scenario())
    finally:
        engine.fault_injector = None
    assert any(isinstance(o, Exception) for o in outputs)  # the deadline cut the requests mid-generation
    assert checked.overlapping_calls == []
    assert not engine.has_unfinished_requests()  # the aborts reached the engine before the loop stopped


def test_steps_go_on_while_the_event_loop_is_busy_and_a_late_reader_gets_the_newest_output(make_llm, monkeypatch):
    """The step thread runs steps back to back and hands each one's outputs to the loop as they come: a loop
    busy with other work (streaming, parsing) does not hold the next step back. The outputs its reader missed
    meanwhile are merged into the newest (each holds all tokens so far): the reader takes one output for them,
    in order, and loses no token."""
    llm = make_llm("tiny")
    engine = llm.engine
    step_ends: list[float] = []
    step = engine.step

    def timed_step():
        out = step()
        step_ends.append(time.monotonic())
        return out

    monkeypatch.setattr(engine, "step", timed_step)  # the engine is the session's: undone after the test
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = list(llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params,
                                 use_tqdm=False)[0].outputs[0].token_ids)
    step_ends.clear()

    async def scenario():
        front = AsyncLLMEngine(engine, log_stats=False)
        lengths, busy = [], None
        async for out in front.generate("r0", prompt_token_ids=[1, 2, 3], params=params):
            lengths.append(len(out.outputs[0].token_ids))
            tokens = list(out.outputs[0].token_ids)
            if len(lengths) == 2:
                start = time.monotonic()
                time.sleep(0.3)  # the loop is blocked: only the step thread can move on
                busy = (start, time.monotonic())
        await front.shutdown(timeout_s=1.0)
        return lengths, busy, tokens

    lengths, (start, end), tokens = asyncio.run(scenario())
    during = [t for t in step_ends if start < t < end]
    assert len(during) >= 5, f"{len(during)} steps ended while the loop was blocked for 0.3 s"
    # (a fast CPU may merge outputs before the block too: [1, 16, ...] on a Zen 5, where a step takes ~0.1 ms)
    assert lengths[0] >= 1 and lengths[-1] == 60 and lengths == sorted(set(lengths))
    # The outputs of the steps that ended while the loop was blocked came as one (the finished one, never
    # replaced, on its own).
    assert lengths[2] >= lengths[1] + len(during) - 1, (lengths, len(during))
    assert len(lengths) <= 60 - len(during) + 2, (lengths, len(during))
    assert tokens == expected  # nothing lost in the merge
    assert not engine.has_unfinished_requests()


def test_a_slow_reader_of_many_prompts_holds_one_output_a_prompt(make_llm):
    """A request of several prompts (server/streaming.py run_job) whose reader stops reading: the outputs made
    meanwhile are merged per prompt as one prompt's are (each holds all of its prompt's tokens so far), so the
    reader then takes one output a prompt with every token, not one per step (which grew with the output's length
    squared: 256 prompts of long outputs held gigabytes)."""
    from server.job import Job, JobKind
    from server.streaming import run_job

    llm = make_llm("tiny")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
    job = Job(JobKind.COMPLETION, "cmpl-slow-reader", 0, "tiny", prompts, [""] * len(prompts), params)

    async def scenario():
        front = AsyncLLMEngine(llm.engine, log_stats=False)
        outputs = run_job(front, job)
        first = [await outputs.__anext__()]
        while front._streams:  # every prompt finished while the reader did not read
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # (the tasks that take each prompt's outputs run: ready ones run before a timer)
        rest = [item async for item in outputs]
        await front.shutdown(timeout_s=1.0)
        return first, rest

    first, rest = asyncio.run(scenario())
    assert sorted(i for i, out in rest) == [0, 1, 2, 3], [(i, len(out.outputs[0].token_ids)) for i, out in rest]
    assert all(out.finished and len(out.outputs[0].token_ids) == 24 for _, out in rest)
