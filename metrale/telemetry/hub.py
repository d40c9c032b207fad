"""`Telemetry`: the one place the API process turns what it sees into metrics and events.

`AsyncLLM` tells it of each engine request it sends, of each delta it hands a caller, and of
each batch of engine outputs (the KV pool's state and the steps' figures travel with them over
the engine's IPC). From those it keeps the Prometheus series exact and publishes events on the
bus. Per-request figures follow vLLM V1: TTFT and end-to-end latency from the request's arrival
at the API; queue and prefill time from the engine's own milestones; one inter-token latency per
token after the first. Everything here runs on the event loop; nothing waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from metrale.engine.messages import (
    EngineRequest,
    KVCacheStats,
    Outputs,
    RequestTiming,
    SpecDecodeStats,
)
from metrale.frontend.output_processor import CompletionDelta
from metrale.telemetry import events
from metrale.telemetry.bus import EventBus
from metrale.telemetry.metrics import Metrics

SUMMARY_INTERVAL_S = 0.1  # step summaries at most 10 a second


@dataclass(slots=True)
class _Live:
    """One engine request in flight, as the API process sees it."""

    request_id: str
    api: str
    prompt_tokens: int
    arrival_s: float
    cached_tokens: int = 0
    generated: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    timing: RequestTiming | None = None  # the engine's milestones, with its first output


class Telemetry:
    def __init__(
        self,
        metrics: Metrics | None,
        bus: EventBus | None = None,
        clock: Callable[[], float] = time.monotonic,
        reports_engine: bool = True,
    ) -> None:
        self.metrics = metrics
        # Whether the engine's own figures (its gauges, steps and pool counters) are this
        # process's to report: with several API processes only the first's are (each gets them).
        self.reports_engine = reports_engine
        self.bus = bus or EventBus()
        self.clock = clock
        self.live: dict[str, _Live] = {}
        self._kv: KVCacheStats | None = None  # the engine's cumulative counts, last seen
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._generated_counted = 0  # of those, what the Prometheus counter has
        self._observe_itl = metrics.inter_token_latency.observe if metrics is not None else _ignore
        self._summary = _SummaryWindow(clock())

    # -- requests ------------------------------------------------------------------------------

    def request_added(self, request: EngineRequest, api: str) -> None:
        live = _Live(request.request_id, api, len(request.prompt_token_ids), request.arrival_time_s)
        self.live[request.request_id] = live
        if self.bus.has_subscribers:
            self.bus.publish(
                events.RequestAdmitted(
                    request_id=live.request_id,
                    api=api,
                    prompt_tokens=live.prompt_tokens,
                    max_tokens=request.sampling_params.max_tokens,
                )
            )

    def deltas(
        self,
        deltas: list[CompletionDelta],
        timings: dict[str, RequestTiming],
        now: float,
    ) -> None:
        """One batch of deltas handed to their callers (`now`: when the batch arrived;
        `timings`: the engine's milestones of the requests whose first output it brought).
        This is the API process's per-token path, so it does the least it can per delta: the
        inter-token latencies of one-token deltas are counted by when their request's previous
        token came (in steady decoding, one previous batch for all of them) and observed once
        per distinct gap; the generation counter catches up once per batch
        (`engine_outputs`)."""
        live_of = self.live.get
        gaps: dict[float, int] = {}  # previous token's time -> one-token deltas since then
        generated = 0
        for delta in deltas:
            live = live_of(delta.request_id)
            if live is None:
                continue
            num_tokens = len(delta.token_ids)
            if num_tokens:
                last = live.last_token_s
                if last is None:
                    timing = timings.get(delta.request_id)
                    self._first_token(live, num_tokens, delta.num_cached_tokens, timing, now)
                elif num_tokens == 1:
                    gaps[last] = gaps.get(last, 0) + 1
                else:
                    self._observe_itl((now - last) / num_tokens, num_tokens)
                live.generated += num_tokens
                live.last_token_s = now
                generated += num_tokens
            if delta.finish_reason is not None:
                if delta.watchdog is not None:
                    self.watchdog_fired(delta.watchdog)
                self._finish(live, delta.finish_reason, now)
        self._generated_tokens += generated
        for last, count in gaps.items():
            self._observe_itl(now - last, count)

    def _first_token(
        self,
        live: _Live,
        num_tokens: int,
        num_cached: int,
        timing: RequestTiming | None,
        now: float,
    ) -> None:
        live.first_token_s = now
        live.cached_tokens = num_cached
        live.timing = timing
        self._prompt_tokens += live.prompt_tokens
        ttft = now - live.arrival_s
        if (metrics := self.metrics) is not None:
            metrics.prompt_tokens.inc(live.prompt_tokens)
            metrics.time_to_first_token.observe(ttft)
        if num_tokens > 1:  # tokens that arrive together are 0 s apart
            self._observe_itl(0.0, num_tokens - 1)
        if self.bus.has_subscribers:
            self.bus.publish(
                events.RequestFirstToken(
                    request_id=live.request_id, cached_tokens=num_cached, ttft_s=ttft
                )
            )

    def request_closed(self, request_id: str, ended: CompletionDelta | None = None) -> None:
        """The caller left before the request finished: an abort (a disconnect, a timeout),
        unless the caller `ended` it, marking its last delta finished (a stop the API saw)."""
        live = self.live.get(request_id)
        if live is not None:
            if ended is not None and ended.watchdog is not None:
                self.watchdog_fired(ended.watchdog)
            reason = ended.finish_reason if ended is not None else None
            self._finish(live, reason or "abort", self.clock())

    def watchdog_fired(self, watchdog: str) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.watchdog_fires, watchdog).inc()

    def _finish(self, live: _Live, reason: str, now: float) -> None:
        del self.live[live.request_id]
        e2e = now - live.arrival_s
        timing = live.timing
        queue = prefill = None
        if timing is not None and timing.scheduled_s is not None:
            queue = timing.scheduled_s - timing.queued_s
            if timing.first_token_s is not None:
                prefill = timing.first_token_s - timing.scheduled_s
        decode = None
        if live.first_token_s is not None and live.last_token_s is not None:
            decode = live.last_token_s - live.first_token_s
        if (metrics := self.metrics) is not None:
            metrics.child(metrics.request_success, reason).inc()
            metrics.e2e_request_latency.observe(e2e)
            metrics.request_prompt_tokens.observe(live.prompt_tokens)
            metrics.request_generation_tokens.observe(live.generated)
            if queue is not None:
                metrics.request_queue_time.observe(queue)
            if prefill is not None and decode is not None:
                metrics.request_prefill_time.observe(prefill)
                metrics.request_decode_time.observe(decode)
                metrics.request_inference_time.observe(prefill + decode)
            if decode is not None and live.generated > 1:
                metrics.request_time_per_output_token.observe(decode / (live.generated - 1))
        ttft = None if live.first_token_s is None else live.first_token_s - live.arrival_s
        if self.bus.has_subscribers:
            self.bus.publish(
                events.RequestFinished(
                    request_id=live.request_id,
                    api=live.api,
                    finish_reason=reason,
                    prompt_tokens=live.prompt_tokens,
                    cached_tokens=live.cached_tokens,
                    generated_tokens=live.generated,
                    queue_s=queue,
                    ttft_s=ttft,
                    decode_s=decode,
                    e2e_s=e2e,
                )
            )

    # -- the engine ----------------------------------------------------------------------------

    def engine_outputs(self, batch: Outputs, now: float) -> None:
        """The engine's state and its steps' figures, as one batch of outputs brought them."""
        if not self.reports_engine:
            self.flush()
            return
        kv, previous = batch.kv_cache, self._kv
        self._kv = kv
        metrics = self.metrics
        if metrics is not None:
            self.flush()
            metrics.num_requests_running.set(kv.num_running)
            metrics.num_requests_waiting.set(kv.num_waiting)
            metrics.kv_cache_usage_perc.set(kv.usage)
            for engine, core_kv in enumerate(batch.engines or ()):
                if core_kv is not None:
                    label = str(engine)
                    metrics.child(metrics.num_requests_running_per_engine, label).set(
                        core_kv.num_running
                    )
                    metrics.child(metrics.num_requests_waiting_per_engine, label).set(
                        core_kv.num_waiting
                    )
                    metrics.child(metrics.kv_cache_usage_perc_per_engine, label).set(core_kv.usage)
            # The engine counts from its start; the counters grow by what it added since.
            metrics.num_preemptions.inc(kv.num_preemptions - _count(previous, "num_preemptions"))
            metrics.prefix_cache_queries.inc(
                kv.num_prefix_queried_tokens - _count(previous, "num_prefix_queried_tokens")
            )
            metrics.prefix_cache_hits.inc(
                kv.num_prefix_hit_tokens - _count(previous, "num_prefix_hit_tokens")
            )
            metrics.recomputed_tokens.inc(
                kv.num_recomputed_tokens - _count(previous, "num_recomputed_tokens")
            )
            if kv.swap is not None:
                self._swap_metrics(kv, previous)
            if kv.spec_decode is not None:
                self._spec_decode_metrics(kv.spec_decode, previous)
            for step in batch.steps:
                metrics.iteration_tokens.observe(step.num_tokens)
                if step.host_s is not None:
                    metrics.child(metrics.engine_step_seconds, "host").observe(step.host_s)
                if step.device_s is not None:
                    metrics.child(metrics.engine_step_seconds, "device").observe(step.device_s)
                if step.cuda_graph:
                    metrics.cuda_graph_replays.inc()
                if step.thinking_loops_closed:
                    fires = metrics.child(metrics.watchdog_fires, "thinking_loop")
                    fires.inc(step.thinking_loops_closed)
        self._summary.steps += len(batch.steps)
        if not self.bus.has_subscribers:
            return
        for step in batch.steps:
            for request_id in step.preempted:
                self.bus.publish(events.Preemption(request_id=request_id))
        idle = kv.num_running == 0 and kv.num_waiting == 0
        self._summary.busy |= not idle
        if now - self._summary.start_s >= SUMMARY_INTERVAL_S or (idle and self._summary.busy):
            self.bus.publish(self._summarize(kv, now, batch.engines))

    def _swap_metrics(self, kv: KVCacheStats, previous: KVCacheStats | None) -> None:
        metrics, swap = self.metrics, kv.swap
        assert metrics is not None and swap is not None
        before = None if previous is None else previous.swap
        metrics.num_requests_swapped.set(swap.num_swapped_requests)
        metrics.cpu_cache_usage_perc.set(swap.num_used_blocks / swap.num_blocks)
        for direction, now_count, then_count in (
            ("out", swap.blocks_out, 0 if before is None else before.blocks_out),
            ("in", swap.blocks_in, 0 if before is None else before.blocks_in),
        ):
            metrics.child(metrics.swapped_blocks, direction).inc(now_count - then_count)

    def _spec_decode_metrics(self, spec: SpecDecodeStats, previous: KVCacheStats | None) -> None:
        metrics = self.metrics
        assert metrics is not None
        before = None if previous is None else previous.spec_decode
        for counter, name in (
            (metrics.spec_decode_num_drafts, "num_drafts"),
            (metrics.spec_decode_num_draft_tokens, "num_draft_tokens"),
            (metrics.spec_decode_num_accepted_tokens, "num_accepted_tokens"),
        ):
            counter.inc(getattr(spec, name) - (0 if before is None else getattr(before, name)))
        for position, count in enumerate(spec.accepted_per_position):
            then = 0 if before is None else before.accepted_per_position[position]
            if count > then:
                per_position = metrics.spec_decode_num_accepted_tokens_per_pos
                metrics.child(per_position, str(position)).inc(count - then)

    def _summarize(
        self, kv: KVCacheStats, now: float, engines: list[KVCacheStats | None] | None
    ) -> events.StepSummary:
        window = self._summary
        elapsed = max(now - window.start_s, 1e-9)
        queried = kv.num_prefix_queried_tokens - window.prefix_queried
        hit = kv.num_prefix_hit_tokens - window.prefix_hits
        summary = events.StepSummary(
            running=kv.num_running,
            waiting=kv.num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_hit_rate=hit / queried if queried else None,
            prompt_tokens_per_s=(self._prompt_tokens - window.prompt_tokens) / elapsed,
            generation_tokens_per_s=(self._generated_tokens - window.generated_tokens) / elapsed,
            steps=window.steps,
            live=[events.LiveRequest(r.request_id, r.generated) for r in self.live.values()],
            engines=[
                events.EngineLoad(i, core.num_running, core.num_waiting, core.usage)
                for i, core in enumerate(engines or ())
                if core is not None
            ],
        )
        self._summary = _SummaryWindow(
            now,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated_tokens,
            prefix_queried=kv.num_prefix_queried_tokens,
            prefix_hits=kv.num_prefix_hit_tokens,
        )
        return summary

    def flush(self) -> None:
        """Bring the generation counter up to the tokens handed out (each batch, and before a
        scrape)."""
        if self.metrics is not None and self._generated_tokens != self._generated_counted:
            self.metrics.generation_tokens.inc(self._generated_tokens - self._generated_counted)
            self._generated_counted = self._generated_tokens

    def exposition(self) -> bytes:
        """This process's series in Prometheus' text format, brought up to date."""
        assert self.metrics is not None
        self.flush()
        self.metrics.event_subscribers.set(self.bus.num_readers)  # (not the peers' links)
        return self.metrics.render()[0]

    # -- the routes ----------------------------------------------------------------------------

    def reasoning_tokens(self, count: int) -> None:
        if self.metrics is not None and count:
            self.metrics.reasoning_tokens.inc(count)

    def tool_calls(self, parser: str, outcomes: dict[str, int]) -> None:
        if self.metrics is None:
            return
        for outcome, count in outcomes.items():
            if count:
                self.metrics.child(self.metrics.tool_calls, parser, outcome).inc(count)


def _ignore(value: float, times: int = 1) -> None:
    pass


def _count(kv: KVCacheStats | None, name: str) -> int:
    return 0 if kv is None else getattr(kv, name)


@dataclass(slots=True)
class _SummaryWindow:
    """The counts at the start of the interval the next summary covers."""

    start_s: float
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefix_queried: int = 0
    prefix_hits: int = 0
    steps: int = 0
    busy: bool = False  # the engine had work in the interval (its going idle is summarized)
