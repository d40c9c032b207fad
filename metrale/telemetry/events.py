"""The telemetry events a running server publishes: what `/v1/events` streams and the TUI reads.

Each event is a `msgspec.Struct` tagged by its `type` field, so a stream of them encodes to
JSON objects that say what they are (`{"type": "request.finished", ...}`) and decodes back into
the same classes (`decode`). `time` is the wall clock (Unix seconds) when the event happened;
durations are in seconds.
"""

from __future__ import annotations

import time

import msgspec


class Event(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    time: float = msgspec.field(default_factory=time.time)


class Phase(Event, frozen=True, tag="phase"):
    """A startup phase began (`duration_s` None) or ended (its duration)."""

    index: int  # 1-based, of `total`
    total: int
    name: str
    duration_s: float | None = None
    detail: str = ""


class RequestAdmitted(Event, frozen=True, tag="request.admitted"):
    """An engine request was sent to the engine (one per choice of an API request)."""

    request_id: str
    api: str  # the route that made it: chat, completions, messages, offline
    prompt_tokens: int
    max_tokens: int | None


class RequestFirstToken(Event, frozen=True, tag="request.first_token"):
    request_id: str
    cached_tokens: int
    ttft_s: float


class RequestFinished(Event, frozen=True, tag="request.finished"):
    request_id: str
    api: str
    finish_reason: str  # stop | length | abort
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    queue_s: float | None  # None: it never left the queue
    ttft_s: float | None  # None: it ended before a first token
    decode_s: float | None  # first token to last
    e2e_s: float


class Preemption(Event, frozen=True, tag="preemption"):
    """The engine preempted a running request (its KV blocks swapped to the host or freed, to be
    recomputed)."""

    request_id: str


class LiveRequest(msgspec.Struct, frozen=True):
    request_id: str
    generated_tokens: int


class EngineLoad(msgspec.Struct, frozen=True):
    """One engine core's share of a summary, under data parallelism."""

    engine: int
    running: int
    waiting: int
    kv_cache_usage: float


class StepSummary(Event, frozen=True, tag="step"):
    """The engine's state, at most `SUMMARY_HZ` times a second while it works, and once when it
    goes idle. Rates are over the interval since the previous summary."""

    running: int
    waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_hit_rate: float | None  # hits / queries since the previous summary
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    steps: int  # engine steps in the interval
    live: list[LiveRequest] = msgspec.field(default_factory=list)  # generated so far, each
    # each core's, under data parallelism (the figures above sum them); empty: one core
    engines: list[EngineLoad] = msgspec.field(default_factory=list)


class Log(Event, frozen=True, tag="log"):
    level: str
    logger: str
    message: str


class Dropped(Event, frozen=True, tag="dropped"):
    """This subscriber fell behind and lost `count` events since it was last told."""

    count: int


AnyEvent = Phase | RequestAdmitted | RequestFirstToken | RequestFinished | Preemption
AnyEvent |= StepSummary | Log | Dropped
EVENT_TYPES: frozenset[str] = frozenset(
    cls.__struct_config__.tag  # type: ignore[misc]
    for cls in (
        Phase,
        RequestAdmitted,
        RequestFirstToken,
        RequestFinished,
        Preemption,
        StepSummary,
        Log,
        Dropped,
    )
)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes | str) -> Event:
    return _decoder.decode(data)


def type_of(event: Event) -> str:
    return event.__struct_config__.tag  # type: ignore[return-value]
