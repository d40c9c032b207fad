"""`DashboardState`: what the dashboard knows, built from telemetry events alone.

It owns plain Python data and no terminal: `apply(event)` folds one event in, and the queries
(`phase_rows`, `live_rows`, `ttft`, `itl`, `logs_since`) read it back, so tests drive it with
hand-made events. What stays true:

- `apply` never raises. An event of a type it does not know is counted in `num_ignored`; one
  whose fields do not hold what their types say (None, strings, NaN) is read as far as it makes
  sense and, if it still cannot be applied, counted there too with a log line saying why.
- A request is in `live` from its `RequestAdmitted` until its `RequestFinished`. After a
  `Dropped` gap the next `StepSummary` resets the table to that summary's `live` list, which
  names every request the API process has in flight, so a lost finish cannot leave a row behind.
- Memory is bounded: the throughput histories, the latency window and the log keep at most a
  fixed number of entries however many events arrive.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metrale.telemetry import events

HISTORY_LEN = 60  # step summaries the throughput sparklines show
LATENCY_WINDOW_S = 60.0
MAX_LATENCY_SAMPLES = 20_000  # the latency window's cap when more requests finish in a minute
MAX_LOG_LINES = 500
UNKNOWN_API = "?"
TUI_LOGGER = "metrale.tui"


class PhaseStatus(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted, no token yet
    DECODING = "decoding"  # its first token came


@dataclass(slots=True)
class PhaseRow:
    index: int  # 1-based
    name: str  # "" while the phase has not begun: its name is not known yet
    status: PhaseStatus
    duration_s: float | None = None
    detail: str = ""


@dataclass(slots=True)
class LiveRow:
    request_id: str
    api: str
    status: RequestStatus
    prompt_tokens: int | None  # None: its admission was lost in a gap
    cached_tokens: int | None  # None until its first token
    generated_tokens: int
    admitted_s: float | None  # event time of its admission; None: not known

    def age_s(self, now_s: float) -> float | None:
        return None if self.admitted_s is None else max(0.0, now_s - self.admitted_s)


@dataclass(frozen=True, slots=True)
class LogLine:
    time_s: float | None
    level: str
    logger: str
    message: str


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50_s: float | None  # None: no samples
    p99_s: float | None
    num_samples: int


@dataclass(frozen=True, slots=True)
class _Finished:
    time_s: float
    ttft_s: float | None
    itl_s: float | None


def percentile(values: list[float], q: int) -> float:
    """The nearest-rank `q`th percentile of non-empty `values`: the smallest value that at least
    `q` percent of the values are at or below (so always one of the values)."""
    ordered = sorted(values)
    rank = max(1, -(-q * len(ordered) // 100))  # ceil(q * n / 100) in integers
    return ordered[rank - 1]


def percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(None, None, 0)
    return Percentiles(percentile(values, 50), percentile(values, 99), len(values))


class DashboardState:
    """Startup phases, engine load, latencies, live requests and log lines, from events."""

    def __init__(self) -> None:
        self.num_phases = 0  # the `total` the phases announce
        self.phases: dict[int, PhaseRow] = {}
        self.num_summaries = 0
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage: float | None = None  # 0..1; None before the first summary
        self.prefix_cache_hit_rate: float | None = None
        self.prompt_tokens_per_s: deque[float] = deque(maxlen=HISTORY_LEN)
        self.generation_tokens_per_s: deque[float] = deque(maxlen=HISTORY_LEN)
        self.live: dict[str, LiveRow] = {}  # in admission order
        self.apis: set[str] = set()  # every API a request came from
        self._finished: deque[_Finished] = deque(maxlen=MAX_LATENCY_SAMPLES)
        self.logs: deque[LogLine] = deque(maxlen=MAX_LOG_LINES)
        self.num_logs = 0  # log lines ever added: `logs_since` counts from it
        self.num_events = 0
        self.num_finished = 0
        self.num_preemptions = 0
        self.num_dropped = 0
        self.num_ignored = 0
        self._resync_live = False  # set by a gap: the next summary resets the live table

    # -- folding events in ---------------------------------------------------------------------

    def apply(self, event: object) -> None:
        self.num_events += 1
        handler = _HANDLERS.get(type(event))
        if handler is None:
            self.num_ignored += 1
            return
        try:
            handler(self, event)
        except Exception as exc:  # the dashboard must outlive any event content
            self.num_ignored += 1
            name = type(event).__name__
            self.add_log("error", TUI_LOGGER, f"could not show a {name} event: {exc!r}")

    def add_log(self, level: str, logger: str, message: str, time_s: float | None = None) -> None:
        self.logs.append(LogLine(time_s, level, logger, message))
        self.num_logs += 1

    def _phase(self, event: events.Phase) -> None:
        index = _int(event.index)
        self.num_phases = max(self.num_phases, _int(event.total), index)
        if index < 1:
            raise ValueError(f"phase index {event.index!r} is not 1 or more")
        name = _text(event.name)
        detail = _text(event.detail)
        duration_s = _float(event.duration_s)
        row = self.phases.get(index)
        if duration_s is None:
            # A replayed start after the end (a late subscriber) must not reopen the phase.
            if row is None or row.status is not PhaseStatus.DONE:
                self.phases[index] = PhaseRow(index, name, PhaseStatus.RUNNING, None, detail)
            return
        if row is not None:
            name, detail = name or row.name, detail or row.detail
        self.phases[index] = PhaseRow(index, name, PhaseStatus.DONE, duration_s, detail)

    def _admitted(self, event: events.RequestAdmitted) -> None:
        api = _text(event.api) or UNKNOWN_API
        self.apis.add(api)
        request_id = _text(event.request_id)
        self.live[request_id] = LiveRow(
            request_id=request_id,
            api=api,
            status=RequestStatus.WAITING,
            prompt_tokens=_int(event.prompt_tokens),
            cached_tokens=None,
            generated_tokens=0,
            admitted_s=_float(event.time),
        )

    def _first_token(self, event: events.RequestFirstToken) -> None:
        row = self.live.get(_text(event.request_id))
        if row is not None:
            row.status = RequestStatus.DECODING
            row.cached_tokens = _int(event.cached_tokens)

    def _finished_request(self, event: events.RequestFinished) -> None:
        self.live.pop(_text(event.request_id), None)
        self.num_finished += 1
        if api := _text(event.api):
            self.apis.add(api)
        time_s = _float(event.time)
        if time_s is None:
            return
        generated = _int(event.generated_tokens)
        decode_s = _float(event.decode_s)
        itl_s = decode_s / (generated - 1) if decode_s is not None and generated > 1 else None
        self._finished.append(_Finished(time_s, _float(event.ttft_s), itl_s))
        while self._finished and self._finished[0].time_s < time_s - LATENCY_WINDOW_S:
            self._finished.popleft()

    def _preemption(self, event: events.Preemption) -> None:
        self.num_preemptions += 1
        self.add_log(
            "warning",
            "metrale.engine",
            f"preempted {_text(event.request_id)}: its KV blocks were freed, it will be recomputed",
            _float(event.time),
        )

    def _summary(self, event: events.StepSummary) -> None:
        self.num_summaries += 1
        self.running = _int(event.running)
        self.waiting = _int(event.waiting)
        usage = _float(event.kv_cache_usage)
        self.kv_cache_usage = None if usage is None else min(1.0, max(0.0, usage))
        self.prefix_cache_hit_rate = _float(event.prefix_cache_hit_rate)
        self.prompt_tokens_per_s.append(max(0.0, _float(event.prompt_tokens_per_s) or 0.0))
        self.generation_tokens_per_s.append(max(0.0, _float(event.generation_tokens_per_s) or 0.0))
        counts = {_text(r.request_id): _int(r.generated_tokens) for r in event.live or ()}
        if self._resync_live:
            self._resync_live = False
            self.live = {rid: row for rid, row in self.live.items() if rid in counts}
            for request_id in counts.keys() - self.live.keys():
                self.live[request_id] = LiveRow(
                    request_id, UNKNOWN_API, RequestStatus.WAITING, None, None, 0, None
                )
        for request_id, generated in counts.items():
            row = self.live.get(request_id)
            if row is None:
                continue
            row.generated_tokens = generated
            if generated > 0:  # its first-token event may have been lost
                row.status = RequestStatus.DECODING

    def _log(self, event: events.Log) -> None:
        level = _text(event.level) or "info"
        self.add_log(level, _text(event.logger), _text(event.message), _float(event.time))

    def _dropped(self, event: events.Dropped) -> None:
        count = _int(event.count)
        self.num_dropped += count
        self._resync_live = True
        self.add_log(
            "warning",
            TUI_LOGGER,
            f"the dashboard fell behind and lost {count:,} events ({self.num_dropped:,} in all)",
            _float(event.time),
        )

    # -- reading it back -----------------------------------------------------------------------

    @property
    def num_phases_done(self) -> int:
        return sum(row.status is PhaseStatus.DONE for row in self.phases.values())

    @property
    def startup_done(self) -> bool:
        return self.num_phases > 0 and self.num_phases_done >= self.num_phases

    @property
    def serving(self) -> bool:
        """Startup is over: every phase ended, or the engine already reports its steps."""
        return self.startup_done or self.num_summaries > 0

    @property
    def startup_s(self) -> float:
        return sum(row.duration_s or 0.0 for row in self.phases.values())

    def phase_rows(self) -> list[PhaseRow]:
        """One row per phase 1..total, pending ones included (their names not known yet)."""
        count = max(self.num_phases, max(self.phases, default=0))
        return [
            self.phases.get(index) or PhaseRow(index, "", PhaseStatus.PENDING)
            for index in range(1, count + 1)
        ]

    def live_rows(self, api: str | None = None) -> list[LiveRow]:
        """The requests in flight, oldest first; only those of `api` unless it is None."""
        return [row for row in self.live.values() if api is None or row.api == api]

    def ttft(self, now_s: float) -> Percentiles:
        """Time to first token of the requests that finished in the last minute (by the event
        time of their `RequestFinished`), from its `ttft_s`; requests without one are left out."""
        return percentiles(self._recent(now_s, lambda f: f.ttft_s))

    def itl(self, now_s: float) -> Percentiles:
        """Inter-token latency over the same window: one sample per finished request, its mean
        gap `decode_s / (generated_tokens - 1)`, for requests that generated two tokens or more."""
        return percentiles(self._recent(now_s, lambda f: f.itl_s))

    def _recent(self, now_s: float, field: Callable[[_Finished], float | None]) -> list[float]:
        since_s = now_s - LATENCY_WINDOW_S
        values = (field(f) for f in self._finished if f.time_s >= since_s)
        return [value for value in values if value is not None]

    def logs_since(self, num_seen: int) -> list[LogLine]:
        """The log lines added after the first `num_seen`, as many as are still kept."""
        num_new = min(self.num_logs - num_seen, len(self.logs))
        return list(self.logs)[-num_new:] if num_new > 0 else []


_HANDLERS: dict[type, Callable[[DashboardState, Any], None]] = {
    events.Phase: DashboardState._phase,
    events.RequestAdmitted: DashboardState._admitted,
    events.RequestFirstToken: DashboardState._first_token,
    events.RequestFinished: DashboardState._finished_request,
    events.Preemption: DashboardState._preemption,
    events.StepSummary: DashboardState._summary,
    events.Log: DashboardState._log,
    events.Dropped: DashboardState._dropped,
}


def _float(value: object) -> float | None:
    """A finite number, or None for anything else (None, NaN, a string that is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _int(value: object) -> int:
    """A count: a non-negative int, 0 for anything that is not a finite number."""
    number = _float(value)
    return max(0, int(number)) if number is not None else 0


def _text(value: object) -> str:
    return "" if value is None else str(value)
