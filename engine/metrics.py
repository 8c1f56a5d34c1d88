"""Prometheus metrics (`pagedserve:` prefix, label model_name) and vLLM's periodic stats log line."""
from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from engine.sampling_params import SamplingParams
from engine.sequence import RequestMetrics, RequestOutput

# vLLM's buckets for the histograms the engine fills (vllm:iteration_tokens_total, vllm:inter_token_latency_seconds).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)


@dataclass
class HistogramCounts:
    """A histogram as counts: counts[i] observations in bucket i (at most bounds[i], above bounds[i - 1]), the last
    past every bound, and their sum. Cumulative, like a counter: the latest snapshot holds every step before it."""

    counts: list[int]
    sum: float = 0.0


class Tally:
    """A HistogramCounts the engine fills as it steps (plain ints: no prometheus in the step, in whatever process
    the engine runs); EngineStats ships snapshots of it to /metrics."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def snapshot(self) -> HistogramCounts:
        return HistogramCounts(list(self.counts), self.sum)


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
    # Prompt tokens of new requests looked up in the prefix cache, and of those the tokens found (vLLM counts tokens).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding (vLLM's counters): sequence-steps that verified proposals, tokens proposed, accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    iteration_tokens: Optional[HistogramCounts] = None  # tokens computed per step (ITERATION_TOKENS_BUCKETS)
    inter_token_latency: Optional[HistogramCounts] = None  # seconds between a sequence's tokens


logger = logging.getLogger("pagedserve.stats")

PREFIX = "pagedserve:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20)
# A request's phases (queue, prefill, decode, inference), as vLLM buckets them.
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0)
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
        self.request_params_n = histogram("request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", _TOKEN_BUCKETS)
        # A request's phases: queue (arrival -> first scheduled), prefill (-> first token), decode (-> last token),
        # inference (first scheduled -> last token); preemptions count in the phase they interrupt.
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _PHASE_BUCKETS)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _PHASE_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _PHASE_BUCKETS)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", _PHASE_BUCKETS)
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.")
        self.iteration_tokens = _EngineHistogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS,
            model_name, self.registry)
        self.inter_token_latency = _EngineHistogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS,
            model_name, self.registry)
        self.engine_resets = counter("engine_resets", "Engine resets after a fault (scheduler, block manager and "
                                     "KV cache rebuilt; the requests in flight end with a 503).")
        self.request_failures = counter("request_failures", "Requests the server ended, by reason: step_fault (a "
                                        "step running it raised, 500), engine_reset (in flight at a reset, 503), "
                                        "admission_fault (adding it to the engine raised, 500).", ("reason",))
        # Every series exists from the start, at 0 (as vLLM's): a scrape before the first request sees them all.
        for metric in (self.num_preemptions, self.prompt_tokens, self.generation_tokens, self.time_to_first_token,
                       self.time_per_output_token, self.e2e_request_latency, self.request_prompt_tokens,
                       self.request_generation_tokens, self.request_params_n, self.request_params_max_tokens,
                       self.request_queue_time, self.request_prefill_time, self.request_decode_time,
                       self.request_inference_time, self.prefix_cache_queries, self.prefix_cache_hits,
                       self.engine_resets, self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
                       self.spec_decode_num_accepted_tokens):
            metric.labels(model_name)
        for reason in ("step_fault", "engine_reset", "admission_fault"):
            self.request_failures.labels(model_name, reason)
        self.cache_config = Info(PREFIX + "cache_config", "The KV cache configuration.", registry=self.registry)
        # The engine's counters are cumulative; Prometheus counters only grow by increments.
        self._last_counters = {"preemptions": 0, "prompt": 0, "generation": 0, "recompute": 0, "swap": 0,
                               "prefix_queries": 0, "prefix_hits": 0, "spec_drafts": 0, "spec_draft_tokens": 0,
                               "spec_accepted": 0}

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
        """Gauges, counters and the engine's histograms from an EngineStats snapshot."""
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
            "prefix_queries": stats.prefix_cache_queries,
            "prefix_hits": stats.prefix_cache_hits,
            "spec_drafts": stats.spec_decode_num_drafts,
            "spec_draft_tokens": stats.spec_decode_num_draft_tokens,
            "spec_accepted": stats.spec_decode_num_accepted_tokens,
        }
        counters = {
            "preemptions": self.num_preemptions.labels(m), "prompt": self.prompt_tokens.labels(m),
            "generation": self.generation_tokens.labels(m),
            "recompute": self.num_preemptions_by_mode.labels(m, "recompute"),
            "swap": self.num_preemptions_by_mode.labels(m, "swap"),
            "prefix_queries": self.prefix_cache_queries.labels(m), "prefix_hits": self.prefix_cache_hits.labels(m),
            "spec_drafts": self.spec_decode_num_drafts.labels(m),
            "spec_draft_tokens": self.spec_decode_num_draft_tokens.labels(m),
            "spec_accepted": self.spec_decode_num_accepted_tokens.labels(m),
        }
        for key, value in current.items():
            delta = value - self._last_counters[key]  # (less than 0 once: the block manager rebuilt at a reset)
            if delta > 0:
                counters[key].inc(delta)
            self._last_counters[key] = value
        self.iteration_tokens.set(stats.iteration_tokens)
        self.inter_token_latency.set(stats.inter_token_latency)

    def record_finished(self, output: RequestOutput, params: Optional[SamplingParams] = None) -> None:
        """Per-request histograms from a finished RequestOutput, its RequestMetrics and the request's parameters."""
        m = self.model_name
        reasons = [c.finish_reason for c in output.outputs]
        if output.error is not None or not reasons or any(r not in _SUCCESS_REASONS for r in reasons):
            return
        for reason in set(reasons):
            self.request_success.labels(m, reason).inc()
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        self.request_prompt_tokens.labels(m).observe(len(output.prompt_token_ids))
        self.request_generation_tokens.labels(m).observe(num_generated)
        if params is not None:
            self.request_params_n.labels(m).observe(params.n)
            if params.max_tokens is not None:
                self.request_params_max_tokens.labels(m).observe(params.max_tokens)
        t = output.metrics
        if t is None:
            return
        self._record_phases(t)
        if t.first_token_time is not None:
            self.time_to_first_token.labels(m).observe(max(0.0, t.first_token_time - t.arrival_time))
        if t.finished_time is not None:
            self.e2e_request_latency.labels(m).observe(max(0.0, t.finished_time - t.arrival_time))
            longest = max((len(c.token_ids) for c in output.outputs), default=0)
            if t.first_token_time is not None and longest > 1:
                self.time_per_output_token.labels(m).observe(
                    max(0.0, t.finished_time - t.first_token_time) / (longest - 1)
                )


    def _record_phases(self, t: RequestMetrics) -> None:
        """Queue, prefill, decode and inference time (a request's last token came in the step that finished it)."""
        m = self.model_name
        scheduled, first, last = t.first_scheduled_time, t.first_token_time, t.finished_time
        if scheduled is None:
            return
        self.request_queue_time.labels(m).observe(max(0.0, scheduled - t.arrival_time))
        if first is not None:
            self.request_prefill_time.labels(m).observe(max(0.0, first - scheduled))
        if first is not None and last is not None:
            self.request_decode_time.labels(m).observe(max(0.0, last - first))
        if last is not None:
            self.request_inference_time.labels(m).observe(max(0.0, last - scheduled))


class _EngineHistogram:
    """A histogram of what the engine counted (HistogramCounts in each EngineStats), shown as of the latest snapshot:
    a collector of its own, since prometheus_client's Histogram takes observations one at a time."""

    def __init__(self, name: str, documentation: str, bounds: tuple, model_name: str,
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.model_name = PREFIX + name, documentation, model_name
        self.les = [floatToGoString(b) for b in bounds] + ["+Inf"]
        self.counts = HistogramCounts([0] * len(self.les))
        registry.register(self)

    def set(self, counts: Optional[HistogramCounts]) -> None:
        if counts is not None and len(counts.counts) == len(self.les):
            self.counts = counts

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        family.add_metric([self.model_name], list(zip(self.les, itertools.accumulate(self.counts.counts))),
                          self.counts.sum)
        return [family]

    describe = collect  # (the registry reads the names, to refuse a duplicate)


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
