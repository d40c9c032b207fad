"""The event bus: bounded queues per subscriber, drops counted and told at the gap, filters,
startup phases replayed, publishing from another thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from metrale.telemetry import events
from metrale.telemetry.bus import EventBus, parse_types


def preemption(i: int) -> events.Preemption:
    return events.Preemption(request_id=f"r{i}")


def drain(subscription) -> list[events.Event]:
    got = []
    while (event := subscription.get_nowait()) is not None:
        got.append(event)
    return got


def test_a_full_queue_loses_the_newest_events_and_says_how_many_at_the_gap():
    bus = EventBus()
    slow = bus.subscribe(capacity=3)
    fast = bus.subscribe(capacity=100)
    for i in range(10):
        bus.publish(preemption(i))
    assert [e.request_id for e in drain(fast)] == [f"r{i}" for i in range(10)]
    got = drain(slow)
    assert [getattr(e, "request_id", None) for e in got[:3]] == ["r0", "r1", "r2"]
    assert isinstance(got[3], events.Dropped) and got[3].count == 7
    assert len(got) == 4 and slow.num_dropped == 7
    # After the gap, events flow again; a later gap is told again, in its place.
    for i in range(10, 15):
        bus.publish(preemption(i))
    got = drain(slow)
    assert [getattr(e, "request_id", None) or e.count for e in got] == ["r10", "r11", "r12", 2]


def test_the_drop_notice_sits_before_the_first_event_that_fits_again():
    bus = EventBus()
    sub = bus.subscribe(capacity=2)
    for i in range(4):
        bus.publish(preemption(i))  # r2, r3 lost
    assert sub.get_nowait().request_id == "r0"
    bus.publish(preemption(4))  # room again: the gap is marked before it
    got = drain(sub)
    assert [type(e).__name__ for e in got] == ["Preemption", "Dropped", "Preemption"]
    assert got[1].count == 2 and got[2].request_id == "r4"


def test_filters_and_families():
    assert parse_types(None) is None and parse_types(" ") is None
    chosen = parse_types("request,step")
    assert chosen == {
        "request.admitted",
        "request.first_token",
        "request.finished",
        "step",
        "dropped",
    }
    with pytest.raises(ValueError, match="unknown event type 'bogus'"):
        parse_types("step,bogus")
    bus = EventBus()
    sub = bus.subscribe(parse_types("preemption"))
    bus.publish(events.Log(level="info", logger="x", message="m"))
    bus.publish(preemption(1))
    assert [events.type_of(e) for e in drain(sub)] == ["preemption"]


def test_phases_are_replayed_to_late_subscribers_and_closing_leaves_the_bus():
    bus = EventBus()
    bus.publish(events.Phase(index=1, total=2, name="a"))
    bus.publish(events.Phase(index=1, total=2, name="a", duration_s=0.5))
    bus.publish(preemption(0))
    late = bus.subscribe()
    assert [(e.name, e.duration_s) for e in drain(late)] == [("a", None), ("a", 0.5)]
    assert bus.num_subscribers == 1
    late.close()
    assert not bus.has_subscribers


def test_events_round_trip_through_json():
    finished = events.RequestFinished(
        request_id="r",
        api="chat",
        finish_reason="stop",
        prompt_tokens=3,
        cached_tokens=0,
        generated_tokens=2,
        queue_s=None,
        ttft_s=0.1,
        decode_s=0.2,
        e2e_s=0.3,
    )
    data = events.encode(finished)
    assert data.startswith(b'{"type":"request.finished"')
    assert events.decode(data) == finished


def test_a_stuck_reader_costs_the_publisher_nothing_and_a_waiting_reader_wakes():
    async def scenario() -> None:
        bus = EventBus()
        bus.bind_loop()
        stuck = bus.subscribe(capacity=8)
        reader = bus.subscribe()
        got: list[events.Event] = []

        async def read() -> None:
            while len(got) < 1000:
                got.append(await reader.get())

        task = asyncio.create_task(read())
        await asyncio.sleep(0)
        for i in range(1000):
            bus.publish(preemption(i))  # never blocks, whoever is behind
        await asyncio.wait_for(task, 5)
        assert [e.request_id for e in got] == [f"r{i}" for i in range(1000)]
        assert stuck.num_dropped == 992

    asyncio.run(scenario())


def test_publishing_from_another_thread_goes_through_the_loop():
    async def scenario() -> None:
        bus = EventBus()
        bus.bind_loop()
        sub = bus.subscribe()
        thread = threading.Thread(target=bus.publish, args=(preemption(7),))
        thread.start()
        thread.join()
        event = await asyncio.wait_for(sub.get(), 5)
        assert event.request_id == "r7"

    asyncio.run(scenario())
