"""The event bus across API processes: a reader anywhere gets every process's events, once, and
a process with no reader among its peers sends nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from metrale.telemetry import events
from metrale.telemetry.bus import EventBus
from metrale.telemetry.event_peers import EventPeers


def _admitted(request_id: str) -> events.RequestAdmitted:
    return events.RequestAdmitted(
        request_id=request_id, api="completions", prompt_tokens=3, max_tokens=8
    )


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


def test_a_reader_gets_the_other_process_events_and_none_twice(tmp_path: Path):
    async def run() -> None:
        buses = [EventBus(), EventBus()]
        peers = []
        for index, bus in enumerate(buses):
            bus.bind_loop()
            peers.append(EventPeers(bus, tmp_path, index, 2))
            peers[-1].start()
        try:
            assert peers[0]._outgoing is None  # no reader anywhere: nothing goes out
            assert not buses[0].has_subscribers  # so nothing is even published
            reader = buses[1].subscribe()
            await _until(lambda: peers[0]._outgoing is not None)
            buses[0].publish(_admitted("from-0"))
            buses[1].publish(_admitted("from-1"))
            got = [await asyncio.wait_for(reader.get(), 5) for _ in range(2)]
            assert sorted(e.request_id for e in got) == ["from-0", "from-1"]
            await asyncio.sleep(0.2)
            assert reader.get_nowait() is None  # nothing came back around
            reader.close()
            await _until(lambda: peers[0]._outgoing is None)  # the last reader left
        finally:
            for p in peers:
                await p.close()

    asyncio.run(run())


def test_a_local_only_subscription_does_not_get_remote_events():
    async def run() -> None:
        bus = EventBus()
        bus.bind_loop()
        changes: list[int] = []
        bus.on_readers_change = changes.append
        reader = bus.subscribe()
        outgoing = bus.subscribe(local_only=True)
        bus.publish(_admitted("remote"), remote=True)
        bus.publish(_admitted("local"))
        assert [reader.get_nowait().request_id for _ in range(2)] == ["remote", "local"]
        assert outgoing.get_nowait().request_id == "local" and outgoing.get_nowait() is None
        reader.close()
        assert changes == [1, 1, 0] and bus.num_readers == 0 and bus.has_subscribers
        # /metrics counts readers, not the links that carry events to other processes
        from metrale.telemetry.hub import Telemetry
        from metrale.telemetry.metrics import Metrics

        text = Telemetry(Metrics("m", 1024), bus).exposition().decode()
        assert 'metrale:event_subscribers{model_name="m"} 0.0' in text.splitlines()

    asyncio.run(run())
