"""Prometheus metrics (`pagedserve:` prefix, label model_name) and vLLM's periodic stats log line."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from engine.sequence import RequestOutput


@dataclass
class EngineStats:
    """A snapshot for /metrics and the periodic log line."""

    num_running: int
    num_waiting: int
    num_swapped: int
    device_cache_usage: float
    cpu_cache_usage: float
    prefix_cache_hit_rate: float
    num_device_blocks: int
    num_cpu_blocks: int
    block_size: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prompt_tokens_total: int
    generation_tokens_total: int


logger = logging.getLogger("pagedserve.stats")

PREFIX = "pagedserve:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# finish reasons that count as a served request; "abort" (client gone) and "error" do not.
_SUCCESS_REASONS = ("stop", "length")


class Metrics:
    """vLLM's metric set, `pagedserve:` prefixed, in one CollectorRegistry (one per engine/app, never global)."""

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.num_requests_running = gauge("num_requests_running", "Number of requests running on the device.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Number of requests swapped to host memory.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Device KV cache usage, 1 means 100 percent.")
        self.cpu_cache_usage_perc = gauge("cpu_cache_usage_perc", "Host swap space usage, 1 means 100 percent.")
        self.prefix_cache_hit_rate = gauge("prefix_cache_hit_rate", "Prefix cache hit rate, 0..1.")
        # prometheus_client appends `_total` to counters: these expose e.g. pagedserve:prompt_tokens_total.
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        # vLLM's total has no mode; recompute and swap cost differently, so operators also get them apart.
        self.num_preemptions_by_mode = counter(
            "num_preemptions_by_mode", "Cumulative number of preemptions, by mode (recompute, swap).", ("mode",)
        )
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("request_success", "Count of successfully finished requests.", ("finished_reason",))
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds", "Time per output token.", _TPOT_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "End to end request latency.", _E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request (all choices).", _TOKEN_BUCKETS
        )
        self.engine_resets = counter("engine_resets", "Engine resets after a fault (scheduler, block manager and "
                                     "KV cache rebuilt; the requests in flight end with a 503).")
        self.request_failures = counter("request_failures", "Requests the server ended, by reason: step_fault (a "
                                        "step running it raised, 500), engine_reset (in flight at a reset, 503), "
                                        "admission_fault (adding it to the engine raised, 500).", ("reason",))
        self.engine_resets.labels(model_name)
        for reason in ("step_fault", "engine_reset", "admission_fault"):
            self.request_failures.labels(model_name, reason)
        self.cache_config = Info(PREFIX + "cache_config", "The KV cache configuration.", registry=self.registry)
        # The engine's counters are cumulative; Prometheus counters only grow by increments.
        self._last_counters = {"preemptions": 0, "prompt": 0, "generation": 0, "recompute": 0, "swap": 0}

    def set_cache_config(self, stats: EngineStats) -> None:
        self.cache_config.info(
            {
                "model_name": self.model_name,
                "block_size": str(stats.block_size),
                "num_device_blocks": str(stats.num_device_blocks),
                "num_cpu_blocks": str(stats.num_cpu_blocks),
            }
        )

    def record_stats(self, stats: EngineStats) -> None:
        """Gauges and counters from an EngineStats snapshot."""
        m = self.model_name
        self.num_requests_running.labels(m).set(stats.num_running)
        self.num_requests_waiting.labels(m).set(stats.num_waiting)
        self.num_requests_swapped.labels(m).set(stats.num_swapped)
        self.kv_cache_usage_perc.labels(m).set(stats.device_cache_usage)
        self.cpu_cache_usage_perc.labels(m).set(stats.cpu_cache_usage)
        self.prefix_cache_hit_rate.labels(m).set(stats.prefix_cache_hit_rate)
        current = {
            "preemptions": stats.num_preemptions_recompute + stats.num_preemptions_swap,
            "prompt": stats.prompt_tokens_total,
            "generation": stats.generation_tokens_total,
            "recompute": stats.num_preemptions_recompute,
            "swap": stats.num_preemptions_swap,
        }
        counters = {
            "preemptions": self.num_preemptions.labels(m), "prompt": self.prompt_tokens.labels(m),
            "generation": self.generation_tokens.labels(m),
            "recompute": self.num_preemptions_by_mode.labels(m, "recompute"),
            "swap": self.num_preemptions_by_mode.labels(m, "swap"),
        }
        for key, value in current.items():
            delta = value - self._last_counters[key]
            if delta > 0:
                counters[key].inc(delta)
            self._last_counters[key] = value

    def record_finished(self, output: RequestOutput) -> None:
        """Per-request histograms from a finished RequestOutput and its RequestMetrics."""
        m = self.model_name
        reasons = [c.finish_reason for c in output.outputs]
        if output.error is not None or not reasons or any(r not in _SUCCESS_REASONS for r in reasons):
            return
        for reason in set(reasons):
            self.request_success.labels(m, reason).inc()
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        self.request_prompt_tokens.labels(m).observe(len(output.prompt_token_ids))
        self.request_generation_tokens.labels(m).observe(num_generated)
        t = output.metrics
        if t is None:
            return
        if t.first_token_time is not None:
            self.time_to_first_token.labels(m).observe(max(0.0, t.first_token_time - t.arrival_time))
        if t.finished_time is not None:
            self.e2e_request_latency.labels(m).observe(max(0.0, t.finished_time - t.arrival_time))
            longest = max((len(c.token_ids) for c in output.outputs), default=0)
            if t.first_token_time is not None and longest > 1:
                self.time_per_output_token.labels(m).observe(
                    max(0.0, t.finished_time - t.first_token_time) / (longest - 1)
                )


class StatLogger:
    """vLLM's periodic line: throughput, queue sizes, cache usage; every interval_s while busy."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0

    def maybe_log(self, stats: EngineStats, now: Optional[float] = None) -> Optional[str]:
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        prompt_tps = (stats.prompt_tokens_total - self._last_prompt) / elapsed
        gen_tps = (stats.generation_tokens_total - self._last_generation) / elapsed
        self._last_time, self._last_prompt, self._last_generation = (
            now, stats.prompt_tokens_total, stats.generation_tokens_total,
        )
        line = (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Swapped: {stats.num_swapped} reqs, "
            f"Pending: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.device_cache_usage * 100:.1f}%, "
            f"CPU KV cache usage: {stats.cpu_cache_usage * 100:.1f}%."
        )
        logger.info(line)
        return line
