"""The Prometheus metrics `GET /metrics` serves, in a registry of the server's own.

The engine's series carry vLLM V1's names and meanings under the `metrale:` prefix, so a vLLM
dashboard ports by swapping the prefix; every series is labelled `model_name`. Counters are
declared without their `_total` suffix: prometheus-client writes `# TYPE metrale:x counter` and
the `metrale:x_total` sample, as vLLM's do. `Telemetry` (`telemetry/hub.py`) updates them.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import generate_latest

# `_created` series double every counter and histogram; vLLM turns them off too.
prometheus_client.disable_created_metrics()

PREFIX = "metrale:"
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the classic text format
FINISH_REASONS = ("stop", "length", "abort")
REJECTION_REASONS = (
    "invalid_api_key",
    "request_too_large",
    "requests",
    "tokens",
    "server_overloaded",
)

# vLLM V1's buckets (vllm/v1/metrics/loggers.py), so the same dashboards read the same bins.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0,
)  # fmt: skip


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return buckets
            buckets.append(value)
        exponent += 1


class Metrics:
    """Every series, bound to one model name. `registry` is the server's own, never the
    process-global one, so several servers (tests) can live in one process."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]

        # A series with no label but the model's is bound to it here (one lookup at startup,
        # none per observation); the others are bound per label value by `child`.
        def bound(metric: Any, extra: tuple[str, ...]) -> Any:
            return metric if extra else metric.labels(model_name)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            metric = Gauge(PREFIX + name, doc, [*labels, *extra], registry=self.registry)
            return bound(metric, extra)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            metric = Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)
            return bound(metric, extra)

        def histogram(name: str, doc: str, buckets, extra: tuple[str, ...] = ()) -> Histogram:
            metric = Histogram(
                PREFIX + name, doc, [*labels, *extra], buckets=buckets, registry=self.registry
            )
            return bound(metric, extra)

        token_buckets = one_two_five_buckets(max_model_len)
        # vLLM's
        self.num_requests_running = gauge("num_requests_running", "Requests in decode or prefill")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be run")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)"
        )
        # Each engine core's, under data parallelism (the series above sum every core's)
        self.num_requests_running_per_engine = gauge(
            "num_requests_running_per_engine", "Requests in decode or prefill, by core", ("engine",)
        )
        self.num_requests_waiting_per_engine = gauge(
            "num_requests_waiting_per_engine", "Requests waiting to be run, by core", ("engine",)
        )
        self.kv_cache_usage_perc_per_engine = gauge(
            "kv_cache_usage_perc_per_engine",
            "Fraction of a core's KV-cache blocks in use (0 to 1)",
            ("engine",),
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished prefills")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.watchdog_fires = counter(
            "watchdog_fires", "Generations a watchdog ended, by watchdog", ("watchdog",)
        )
        self.request_success = counter(
            "request_success", "Finished requests, by why they finished", ("finished_reason",)
        )
        self.num_preemptions = counter("num_preemptions", "Preemptions of running requests")
        self.num_requests_swapped = gauge(
            "num_requests_swapped", "Preempted requests whose KV blocks wait in the swap space"
        )
        self.cpu_cache_usage_perc = gauge(
            "cpu_cache_usage_perc", "Fraction of the swap space's host blocks in use (0 to 1)"
        )
        self.swapped_blocks = counter(
            "swapped_blocks",
            "KV blocks copied to (out) and from (in) the swap space",
            ("direction",),
        )
        self.recomputed_tokens = counter(
            "recomputed_tokens", "Tokens computed again after a preemption dropped them"
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Steps of a request that carried speculative drafts"
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative draft tokens checked"
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted"
        )
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted, by their position in the draft",
            ("position",),
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens the prefix cache served"
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS
        )
        self.inter_token_latency = PerTokenHistogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive tokens",
            ITL_BUCKETS,
            model_name,
        )
        self.registry.register(self.inter_token_latency)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency", REQUEST_LATENCY_BUCKETS
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per request: time from first to last token over the tokens after the first",
            ITL_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time waiting before first scheduled",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "Time from first scheduled to first token",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Time from first token to last token",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "Time from first scheduled to last token",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request", token_buckets
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per engine step", ITERATION_TOKEN_BUCKETS
        )
        # ours
        self.http_requests = counter(
            "http_requests", "HTTP requests answered, by route and status", ("route", "status")
        )
        self.rejected_requests = counter(
            "rejected_requests",
            "Requests refused at the edge or at admission, by reason (invalid_api_key, "
            "request_too_large, requests, tokens, server_overloaded)",
            ("reason",),
        )
        self.tool_calls = counter(
            "tool_calls",
            "Tool calls in model output, by parser and outcome (parsed, repaired, text)",
            ("parser", "outcome"),
        )
        self.reasoning_tokens = counter("reasoning_tokens", "Generated tokens inside reasoning")
        self.engine_step_seconds = histogram(
            "engine_step_seconds",
            "Engine step time: host (scheduling, input preparation, output handling) and device "
            "(the forward and sampling; on a CPU the forward's wall time)",
            STEP_SECONDS_BUCKETS,
            ("part",),
        )
        self.cuda_graph_replays = counter(
            "cuda_graph_replays", "Engine steps run as one CUDA graph replay"
        )
        self.event_subscribers = gauge("event_subscribers", "Readers of /v1/events")
        self.events_dropped = counter(
            "events_dropped", "Telemetry events lost by subscribers that fell behind"
        )

        # Series a dashboard reads exist from the start, at zero.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        for reason in FINISH_REASONS:
            self.child(self.request_success, reason)
        for part in ("host", "device"):
            self.child(self.engine_step_seconds, part)
        for reason in REJECTION_REASONS:
            self.child(self.rejected_requests, reason)

    def child(self, metric: Any, *values: str) -> Any:
        """`metric` labelled with this model and `values` (cached: label lookups take a lock)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.model_name, *values)
        return child

    def render(self) -> tuple[bytes, str]:
        """The exposition in Prometheus' text format, and its content type. (Not OpenMetrics,
        even when a scraper asks: prometheus-client's OpenMetrics writer escapes the `:` of
        sample names to `_` but not of the `# TYPE` lines, so a dashboard's names would not
        match; Prometheus reads the text format either way, as it does vLLM's.)"""
        return generate_latest(self.registry), TEXT_CONTENT_TYPE


class PerTokenHistogram:
    """A histogram observed once per generated token: plain counts with no lock (the event
    loop is its only writer), collected into a Prometheus histogram at scrape time. A
    `prometheus_client.Histogram` takes a lock and walks its buckets on each observation, which
    at tens of thousands of tokens a second is the API process's time to spend elsewhere."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = [*buckets, math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
        family.add_metric([self.model_name], buckets, self.sum)
        return [family]

    def describe(self) -> list[HistogramMetricFamily]:
        return self.collect()
