"""A deterministic stand-in with LLMEngine's API, for HTTP-layer unit tests only (framing, errors, openapi).

Acceptance tests use the real engine; this double exists so the HTTP layer can be tested in
milliseconds without a model. Tokens are a pure function of (prompt, choice, position).
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.sequence import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    gpu_cache_usage: float = 0.0
    cpu_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_gpu_blocks: int = 256
    num_cpu_blocks: int = 64
    block_size: int = 16
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class _Req:
    def __init__(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        self.request_id, self.ids, self.params = request_id, ids, params
        self.outputs = [[] for _ in range(params.n)]
        self.reasons: list[Optional[str]] = [None] * params.n
        self.metrics = RequestMetrics(time.monotonic())
        self.prefilled = False


class FakeLLMEngine:
    """LLMEngine's public API over a fake model: token t_k = 200 + (sum(prompt) + 31*k + 97*j) % 4000."""

    def __init__(self, tokenizer: Any, max_model_len: int = 256, max_num_seqs: int = 8, step_delay_s: float = 0.002):
        self.config = EngineConfig(max_num_seqs=max_num_seqs)
        self.config.resolve(max_model_len)
        self.tokenizer = tokenizer
        self.hf_config = SimpleNamespace(vocab_size=len(tokenizer))
        self.step_delay_s = step_delay_s
        self.waiting: collections.deque[_Req] = collections.deque()
        self.running: list[_Req] = []
        self.stats = FakeStats()

    @staticmethod
    def token(ids: list[int], k: int, j: int) -> int:
        return 200 + (sum(ids) + 31 * k + 97 * j) % 4000

    def add_request(self, request_id, prompt=None, prompt_token_ids=None, params=None, arrival_time=None, priority=0):
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenizer(prompt)["input_ids"]
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"prompt is too long ({len(ids)} tokens).")
        self.waiting.append(_Req(request_id, ids, params or SamplingParams()))

    def abort_request(self, request_id) -> None:
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        self.waiting = collections.deque(r for r in self.waiting if r.request_id not in ids)
        self.running = [r for r in self.running if r.request_id not in ids]
        self._update_stats()

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_stats(self) -> FakeStats:
        return self.stats

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay_s)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            self.running.append(self.waiting.popleft())
        outputs = []
        for req in self.running:
            if not req.prefilled:
                req.prefilled = True
                self.stats.prompt_tokens_total += len(req.ids)
                req.metrics.first_token_time = time.monotonic()
            for j, out in enumerate(req.outputs):
                if req.reasons[j] is None:
                    out.append(self.token(req.ids, len(out), j))
                    self.stats.generation_tokens_total += 1
                    req.reasons[j] = self._finish_reason(req, j)
            outputs.append(self._to_output(req))
        self.running = [r for r in self.running if not all(r.reasons)]
        self._update_stats()
        return outputs

    def _finish_reason(self, req: _Req, j: int) -> Optional[str]:
        out = req.outputs[j]
        if req.params.stop_token_ids and out[-1] in req.params.stop_token_ids:
            return "stop"
        if any(s in self.tokenizer.decode(out) for s in req.params.stop):
            return "stop"
        if len(out) >= req.params.max_tokens or len(req.ids) + len(out) >= self.config.max_model_len:
            return "length"
        return None

    def _to_output(self, req: _Req) -> RequestOutput:
        choices = []
        for j, out in enumerate(req.outputs):
            text = self.tokenizer.decode(out)
            for s in req.params.stop:
                if s in text and not req.params.include_stop_str_in_output:
                    text = text[: text.index(s)]
            logprobs = None
            if req.params.logprobs is not None:
                logprobs = [self._logprobs(t, req.params.logprobs) for t in out]
            choices.append(CompletionOutput(j, text, list(out), -0.5 * len(out), logprobs, req.reasons[j]))
        finished = all(req.reasons)
        if finished:
            req.metrics.finished_time = time.monotonic()
        prompt_lp = None
        if req.params.prompt_logprobs is not None:
            prompt_lp = [None] + [self._logprobs(t, req.params.prompt_logprobs) for t in req.ids[1:]]
        return RequestOutput(req.request_id, None, req.ids, prompt_lp, choices, finished, metrics=req.metrics)

    @staticmethod
    def _logprobs(token_id: int, k: int) -> dict[int, float]:
        entry = {token_id: -0.5}
        for r in range(k):
            entry.setdefault(token_id + r + 1, -1.0 - r)
        return entry

    def _update_stats(self) -> None:
        used = sum(math.ceil((len(r.ids) + max(map(len, r.outputs))) / 16) * r.params.n for r in self.running)
        self.stats.num_running, self.stats.num_waiting = len(self.running), len(self.waiting)
        self.stats.gpu_cache_usage = min(1.0, used / self.stats.num_gpu_blocks)
