"""What a running server shows of itself: `/metrics` (Prometheus), `/v1/events` (the telemetry
event stream, as server-sent events) and `/forward` (what the model's forward is)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from metrale.server.errors import APIError
from metrale.server.state import ServerState
from metrale.telemetry import events
from metrale.telemetry.bus import DEFAULT_QUEUE_SIZE, Subscription, parse_types
from metrale.telemetry.metrics import TEXT_CONTENT_TYPE
from metrale.telemetry.metrics_peers import merge_expositions

router = APIRouter()

KEEPALIVE_S = 15.0  # an SSE comment this often on a quiet stream, so proxies keep it open
MAX_QUEUE_SIZE = 65536


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    telemetry = state.llm.telemetry
    if telemetry.metrics is None:
        raise APIError("metrics are off on this server", 404)
    body = telemetry.exposition()
    if state.metrics_peers is not None:  # the other API processes' series added in
        body = merge_expositions([body, *await state.metrics_peers.gather()])
    return Response(body, media_type=TEXT_CONTENT_TYPE)


@router.get("/v1/events")
async def event_stream(
    request: Request, types: str | None = None, queue: int = DEFAULT_QUEUE_SIZE
) -> StreamingResponse:
    """Server-sent events, one per telemetry event (`event:` its type, `data:` its JSON).
    `types` picks event types (comma-separated; a family such as `request` takes all of its
    types); `queue` is this reader's buffer: events past it are lost, and told in `dropped`."""
    state: ServerState = request.app.state.server
    try:
        chosen = parse_types(types)
    except ValueError as e:
        raise APIError(str(e), param="types") from None
    if not 1 <= queue <= MAX_QUEUE_SIZE:
        raise APIError(f"queue must be between 1 and {MAX_QUEUE_SIZE} events", param="queue")
    telemetry = state.llm.telemetry
    subscription = telemetry.bus.subscribe(chosen, capacity=queue)
    return StreamingResponse(
        _frames(subscription, telemetry),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


async def _frames(subscription: Subscription, telemetry: Any) -> AsyncIterator[bytes]:
    """The subscription's events as SSE frames. Events come in bursts (a batch of engine
    outputs tells many requests' first tokens at once), so each wake-up sends every event
    waiting as one chunk: one write for the burst, not one per event."""
    try:
        yield b": metrale events\n\n"
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):  # (wait_for can lose a cancel on 3.11)
                    event = await subscription.get()
            except TimeoutError:
                yield b": keepalive\n\n"
                continue
            frames = []
            while event is not None:
                if isinstance(event, events.Dropped) and telemetry.metrics is not None:
                    telemetry.metrics.events_dropped.inc(event.count)
                frames.append(
                    b"event: %s\ndata: %s\n\n"
                    % (events.type_of(event).encode(), events.encode(event))
                )
                event = subscription.get_nowait()
            yield b"".join(frames)
    finally:
        subscription.close()


@router.get("/forward")
async def forward(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    info = state.llm.client.forward
    if info is None:
        raise APIError("the engine has not described its forward yet", 503)
    return {"model": state.settings.served_model_name, **msgspec.to_builtins(info)}
