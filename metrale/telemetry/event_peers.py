"""The event bus across several API processes (`--api-server-count`): a reader of `/v1/events`
or the dashboard, on whichever process, sees every process's requests.

Each process publishes on an XPUB socket and listens to the others' on a SUB socket. It
subscribes to them only while its own bus has readers, and the XPUB tells it whether any peer
subscribes (its first subscription and its last unsubscription come through): only then does a
`local_only` subscription of its bus send its events out, so with no reader anywhere no event is
even built (`Telemetry` publishes only to a bus with subscribers). What comes in is published on
the local bus as `remote`. The engine's own events (steps, preemptions) come from the first
process alone; startup phases are not sent (each reader has its own process's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import zmq
import zmq.asyncio

from metrale.telemetry import events
from metrale.telemetry.bus import EventBus, Subscription

logger = logging.getLogger(__name__)

FORWARD_QUEUE_SIZE = 65536  # this process's events waiting to go out, at most


class EventPeers:
    def __init__(self, bus: EventBus, directory: Path, index: int, count: int) -> None:
        self.bus, self.directory, self.index, self.count = bus, directory, index, count
        self._context = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self._outgoing: Subscription | None = None
        self._sending: asyncio.Task[None] | None = None
        self._listening = False

    def _address(self, index: int) -> str:
        return f"ipc://{self.directory}/events-{index}"

    def start(self) -> None:
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.bind(self._address(self.index))
        self._sub = self._context.socket(zmq.SUB)
        for index in range(self.count):
            if index != self.index:
                self._sub.connect(self._address(index))
        self.bus.on_readers_change = self._readers_changed
        self._readers_changed(self.bus.num_readers)
        self._tasks = [
            asyncio.create_task(self._watch_peers(), name="event-peers-subscriptions"),
            asyncio.create_task(self._receive(), name="event-peers-in"),
        ]

    def _readers_changed(self, readers: int) -> None:
        """Listen to the peers while this process has readers."""
        if readers and not self._listening:
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        elif not readers and self._listening:
            self._sub.setsockopt(zmq.UNSUBSCRIBE, b"")
        self._listening = bool(readers)

    async def _watch_peers(self) -> None:
        """Send this process's events while some peer listens."""
        while True:
            message = await self._pub.recv()
            if message[:1] == b"\x01" and self._outgoing is None:
                self._outgoing = self.bus.subscribe(capacity=FORWARD_QUEUE_SIZE, local_only=True)
                self._sending = asyncio.create_task(self._send(self._outgoing))
            elif message[:1] == b"\x00" and self._outgoing is not None:
                await self._stop_sending()

    async def _send(self, outgoing: Subscription) -> None:
        async for event in outgoing:
            if not isinstance(event, events.Phase):
                await self._pub.send(events.encode(event))

    async def _stop_sending(self) -> None:
        if self._outgoing is not None:
            self._outgoing.close()
            self._outgoing = None
        if self._sending is not None:
            self._sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sending
            self._sending = None

    async def _receive(self) -> None:
        while True:
            data = await self._sub.recv()
            try:
                event = events.decode(data)
            except ValueError:  # msgspec's DecodeError: not one of ours
                logger.warning("an API process sent an event that does not decode")
                continue
            self.bus.publish(event, remote=True)

    async def close(self) -> None:
        self.bus.on_readers_change = None
        await self._stop_sending()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pub.close(linger=0)
        self._sub.close(linger=0)
        self._context.term()
