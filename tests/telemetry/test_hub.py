"""`Telemetry`: exact figures from scripted deltas and engine batches, on a clock the test
moves. The same code runs in `met serve` (tests/server/test_observability.py)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metrale.engine.messages import (
    EngineRequest,
    KVCacheStats,
    Outputs,
    RequestTiming,
    StepStats,
)
from metrale.frontend.output_processor import CompletionDelta
from metrale.sampling_params import SamplingParams
from metrale.telemetry import events
from metrale.telemetry.bus import EventBus
from metrale.telemetry.hub import Telemetry
from metrale.telemetry.metrics import ITL_BUCKETS, Metrics, PerTokenHistogram, one_two_five_buckets
from tests.telemetry.test_bus import drain


def samples(metrics: Metrics) -> dict[str, float]:
    body, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def kv(**counts) -> KVCacheStats:
    base = dict(
        num_blocks=100,
        num_used_blocks=0,
        num_cached_blocks=0,
        block_size=16,
        bytes_per_block=1,
        num_prefix_queried_tokens=0,
        num_prefix_hit_tokens=0,
        num_running=0,
        num_waiting=0,
        num_preemptions=0,
    )
    return KVCacheStats(**{**base, **counts})


def delta(request_id: str, tokens: int, finish: str | None = None, cached: int = 0):
    return CompletionDelta(
        request_id, [1] * tokens, "x", None, finish_reason=finish, num_cached_tokens=cached
    )


def test_request_figures_are_exact():
    metrics, bus = Metrics("m", 4096), EventBus()
    telemetry = Telemetry(metrics, bus, clock=lambda: 100.0)
    sub = bus.subscribe()
    request = EngineRequest("a", [5] * 10, SamplingParams(max_tokens=4), arrival_time_s=10.0)
    telemetry.request_added(request, "chat")
    timing = RequestTiming(queued_s=10.5, scheduled_s=11.0, first_token_s=11.75)
    telemetry.deltas([delta("a", 1, cached=4)], {"a": timing}, now=12.0)  # TTFT 2.0
    telemetry.deltas([delta("a", 1)], {}, now=12.5)  # ITL 0.5
    telemetry.deltas([delta("a", 2, finish="length")], {}, now=13.5)  # two tokens, 0.5 apart
    telemetry.flush()  # as /metrics does before it renders
    got = samples(metrics)
    assert got["metrale:prompt_tokens_total{}"] == 10
    assert got["metrale:generation_tokens_total{}"] == 4
    assert got["metrale:request_success_total{finished_reason=length}"] == 1
    assert got["metrale:time_to_first_token_seconds_sum{}"] == 2.0
    assert got["metrale:inter_token_latency_seconds_count{}"] == 3
    assert got["metrale:inter_token_latency_seconds_sum{}"] == 1.5
    assert got["metrale:inter_token_latency_seconds_bucket{le=0.4}"] == 0
    assert got["metrale:inter_token_latency_seconds_bucket{le=0.5}"] == 3  # le is inclusive
    assert got["metrale:request_queue_time_seconds_sum{}"] == 0.5
    assert got["metrale:request_prefill_time_seconds_sum{}"] == 0.75
    assert got["metrale:request_decode_time_seconds_sum{}"] == 1.5
    assert got["metrale:request_inference_time_seconds_sum{}"] == 2.25
    # vLLM's per-request TPOT: 1.5 s from first to last token over the three after the first
    assert got["metrale:request_time_per_output_token_seconds_sum{}"] == 0.5
    assert got["metrale:request_time_per_output_token_seconds_count{}"] == 1
    assert got["metrale:e2e_request_latency_seconds_sum{}"] == 3.5
    assert got["metrale:request_generation_tokens_sum{}"] == 4
    kinds = drain(sub)
    assert [events.type_of(e) for e in kinds] == [
        "request.admitted",
        "request.first_token",
        "request.finished",
    ]
    finished = kinds[-1]
    assert (finished.ttft_s, finished.decode_s, finished.e2e_s) == (2.0, 1.5, 3.5)
    assert (finished.cached_tokens, finished.generated_tokens, finished.queue_s) == (4, 4, 0.5)
    assert not telemetry.live


def test_a_batch_observes_each_tokens_gap_to_its_own_requests_previous_token():
    """One-token deltas are observed grouped by when their request's previous token came;
    the histogram must hold what observing every token alone would."""
    metrics = Metrics("m", 4096)
    telemetry = Telemetry(metrics, clock=lambda: 0.0)
    for name in "abcd":
        telemetry.request_added(EngineRequest(name, [1], SamplingParams(), 0.0), "completions")
    timing = RequestTiming(0.0, 0.0, 0.0)
    telemetry.deltas([delta("a", 1), delta("b", 1)], {"a": timing, "b": timing}, now=1.0)
    telemetry.deltas([delta("c", 1), delta("d", 1)], {"c": timing, "d": timing}, now=1.25)
    # a and b last had a token at 1.0, c and d at 1.25; d brings three tokens at once
    batch = [delta("a", 1), delta("b", 1), delta("c", 1), delta("d", 3, finish="length")]
    telemetry.deltas(batch, {}, now=1.5)
    reference = PerTokenHistogram("x", "doc", ITL_BUCKETS, "m")
    for gap in (0.5, 0.5, 0.25, 0.25 / 3, 0.25 / 3, 0.25 / 3):  # d: 0.25 s over 3 tokens
        reference.observe(gap)
    itl = metrics.inter_token_latency
    assert itl.counts == reference.counts and math.isclose(itl.sum, reference.sum)
    telemetry.flush()
    assert samples(metrics)["metrale:generation_tokens_total{}"] == 10


def test_a_request_the_caller_left_is_an_abort_and_counts_once():
    metrics = Metrics("m", 4096)
    telemetry = Telemetry(metrics, clock=lambda: 20.0)
    telemetry.request_added(EngineRequest("a", [1, 2], SamplingParams(), 10.0), "completions")
    telemetry.request_closed("a")
    telemetry.request_closed("a")  # the caller's cleanup runs again: nothing more
    telemetry.deltas([delta("a", 1)], {}, now=21.0)  # a late output: not counted
    telemetry.flush()
    got = samples(metrics)
    assert got["metrale:request_success_total{finished_reason=abort}"] == 1
    assert got["metrale:e2e_request_latency_seconds_count{}"] == 1
    assert got["metrale:time_to_first_token_seconds_count{}"] == 0
    assert got["metrale:request_queue_time_seconds_count{}"] == 0  # it never left the queue
    assert got["metrale:generation_tokens_total{}"] == 0


def test_engine_counts_grow_by_what_the_engine_added_and_summaries_are_throttled():
    metrics, bus = Metrics("m", 4096), EventBus()
    telemetry = Telemetry(metrics, bus, clock=lambda: 0.0)
    sub = bus.subscribe()
    step = StepStats(
        num_tokens=40, num_requests=2, host_s=0.001, device_s=0.004, cuda_graph=True, preempted=[]
    )
    busy = kv(
        num_used_blocks=25,
        num_running=2,
        num_waiting=1,
        num_prefix_queried_tokens=64,
        num_prefix_hit_tokens=32,
    )
    telemetry.engine_outputs(Outputs([], busy, [], [step, step]), now=0.05)
    preempted = StepStats(1, 1, None, None, False, ["r9"])
    later = kv(num_prefix_queried_tokens=80, num_prefix_hit_tokens=32, num_preemptions=1)
    telemetry.engine_outputs(Outputs([], later, [], [preempted]), now=0.07)
    got = samples(metrics)
    assert got["metrale:prefix_cache_queries_total{}"] == 80
    assert got["metrale:prefix_cache_hits_total{}"] == 32
    assert got["metrale:num_preemptions_total{}"] == 1
    assert got["metrale:iteration_tokens_total_count{}"] == 3
    assert got["metrale:iteration_tokens_total_sum{}"] == 81
    assert got["metrale:engine_step_seconds_count{part=host}"] == 2  # None: not observed
    assert got["metrale:engine_step_seconds_count{part=device}"] == 2
    assert got["metrale:cuda_graph_replays_total{}"] == 2
    assert got["metrale:num_requests_running{}"] == 0  # the latest state
    published = drain(sub)
    # the first batch was within the first 0.1 s and busy: no summary; the second went idle
    assert [events.type_of(e) for e in published] == ["preemption", "step"]
    summary = published[-1]
    assert summary.steps == 3 and summary.running == 0
    assert summary.prefix_cache_hit_rate == 32 / 80


def test_an_api_process_past_the_first_reports_no_engine_figures():
    """With several API processes every one gets the engine's state, the first its steps too:
    only the first turns them into series and events, so a scrape that adds the processes up
    counts each once."""
    metrics, bus = Metrics("m", 4096), EventBus()
    telemetry = Telemetry(metrics, bus, clock=lambda: 0.0, reports_engine=False)
    sub = bus.subscribe()
    step = StepStats(40, 2, 0.001, 0.004, True, ["r9"])
    telemetry.request_added(EngineRequest("r1", [1, 2], SamplingParams(), 0.0), "completions")
    telemetry.deltas([delta("r1", 3)], {}, now=0.01)
    state = kv(num_used_blocks=25, num_running=2, num_prefix_queried_tokens=64, num_preemptions=4)
    telemetry.engine_outputs(Outputs([], state, [], [step]), now=0.05)
    got = samples(metrics)
    assert got["metrale:generation_tokens_total{}"] == 3  # its own streams' tokens, flushed
    assert got["metrale:iteration_tokens_total_count{}"] == 0
    assert got["metrale:num_preemptions_total{}"] == 0
    assert got["metrale:prefix_cache_queries_total{}"] == 0
    assert got["metrale:num_requests_running{}"] == 0
    published = [events.type_of(e) for e in drain(sub)]
    assert "step" not in published and "preemption" not in published


def test_per_token_histogram_writes_what_a_prometheus_histogram_writes():
    values = [0.0, 0.01, 0.0100001, 0.05, 0.3, 79.9, 80.0, 1e6, 0.024999]
    ours = PerTokenHistogram("h_seconds", "doc", ITL_BUCKETS, "m")
    registry = CollectorRegistry()
    registry.register(ours)
    reference_registry = CollectorRegistry()
    reference = Histogram(
        "h_seconds", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=reference_registry
    )
    for v in values:
        ours.observe(v)
        reference.labels("m").observe(v)
    ours.observe(0.2, times=3)
    for _ in range(3):
        reference.labels("m").observe(0.2)

    def lines(registry: CollectorRegistry) -> list[bytes]:  # all but the float sum, exact
        return [line for line in generate_latest(registry).splitlines() if b"_sum" not in line]

    assert lines(registry) == lines(reference_registry)
    assert ours.count == len(values) + 3 and math.isclose(ours.sum, sum(values) + 0.6)


def test_token_buckets_and_the_text_format():
    assert one_two_five_buckets(600) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    metrics = Metrics("m", 600)
    metrics.prompt_tokens.inc(5)
    text, content_type = metrics.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    (family,) = [
        f
        for f in text_string_to_metric_families(text.decode())
        if f.name == "metrale:prompt_tokens"
    ]
    assert family.type == "counter" and family.samples[0].name == "metrale:prompt_tokens_total"
    assert b"_created" not in text
