"""The event bus: every telemetry event goes to every subscriber's bounded queue.

Publishing never blocks and never waits on a subscriber: a subscriber whose queue is full loses
the events that do not fit, counted, and the next thing it reads at that gap is a `Dropped`
event that says how many. So a slow or stuck reader of `/v1/events` costs the engine and the
other subscribers nothing. Startup phases are kept and replayed to each new subscriber, so a
reader that connects late still sees how the server started.

The bus belongs to the event loop that created it; `publish` from another thread (a log
record from the engine thread) is handed to that loop. With several API processes the others'
events come in too (`event_peers.py`), marked `remote`, and a `local_only` subscription (the
one that sends this process's events to them) does not get them back.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable

from metrale.telemetry.events import EVENT_TYPES, Dropped, Event, Phase, type_of

DEFAULT_QUEUE_SIZE = 1024


class Subscription:
    """One reader's queue. Iterate it (async) for events; close it to leave the bus."""

    def __init__(
        self,
        bus: EventBus,
        types: frozenset[str] | None,
        capacity: int,
        local_only: bool = False,
    ) -> None:
        self._bus = bus
        self.types = types
        self.capacity = capacity
        self.local_only = local_only  # this process's events only
        self._queue: deque[Event] = deque()
        self._ready = asyncio.Event()
        self._pending_drops = 0
        self.num_dropped = 0  # over the subscription's life
        self.closed = False

    def wants(self, event: Event) -> bool:
        return self.types is None or type_of(event) in self.types

    def offer(self, event: Event) -> None:
        if not self.wants(event):
            return
        if len(self._queue) >= self.capacity:
            self._pending_drops += 1
            self.num_dropped += 1
            return
        if self._pending_drops:
            self._queue.append(Dropped(count=self._pending_drops))
            self._pending_drops = 0
        self._queue.append(event)
        self._ready.set()

    def get_nowait(self) -> Event | None:
        if self._queue:
            return self._queue.popleft()
        if self._pending_drops:
            count, self._pending_drops = self._pending_drops, 0
            return Dropped(count=count)
        return None

    async def get(self) -> Event:
        while (event := self.get_nowait()) is None:
            self._ready.clear()
            await self._ready.wait()
        return event

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while not self.closed:
            yield await self.get()

    def close(self) -> None:
        self.closed = True
        if self in self._bus._subscribers:
            self._bus._subscribers.discard(self)
            self._bus._readers_changed()


class EventBus:
    def __init__(self) -> None:
        self._subscribers: set[Subscription] = set()
        self._phases: list[Phase] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        # Told the number of readers (the subscriptions not `local_only`) as it changes.
        self.on_readers_change: Callable[[int], None] | None = None

    def bind_loop(self) -> None:
        """Belong to the running event loop (call from it, before other threads publish)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    @property
    def has_subscribers(self) -> bool:
        return bool(self._subscribers)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def num_readers(self) -> int:
        """Subscribers that read what the whole server tells (`/v1/events`, the dashboard)."""
        return sum(not s.local_only for s in self._subscribers)

    def subscribe(
        self,
        types: Iterable[str] | None = None,
        capacity: int = DEFAULT_QUEUE_SIZE,
        *,
        local_only: bool = False,
    ) -> Subscription:
        """A new subscriber for `types` (every type if None; see `parse_types`); `local_only`:
        this process's events, none of its peers'."""
        chosen = None if types is None else frozenset(types)
        subscription = Subscription(self, chosen, capacity, local_only)
        for phase in self._phases:
            subscription.offer(phase)
        self._subscribers.add(subscription)
        self._readers_changed()
        return subscription

    def _readers_changed(self) -> None:
        if self.on_readers_change is not None:
            self.on_readers_change(self.num_readers)

    def publish(self, event: Event, remote: bool = False) -> None:
        """Offer `event` to every subscriber; `remote`: another API process's."""
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self.publish, event, remote)
            return
        if isinstance(event, Phase) and not remote:
            self._phases.append(event)
        for subscription in tuple(self._subscribers):
            if not (remote and subscription.local_only):
                subscription.offer(event)


def parse_types(text: str | None) -> frozenset[str] | None:
    """`types` from a query string: comma-separated event types, where a prefix ending in a dot
    or naming a family (`request`) selects the whole family. None or empty: every type."""
    if not text or not text.strip():
        return None
    chosen: set[str] = set()
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        family = {t for t in EVENT_TYPES if t.startswith(name.rstrip(".") + ".")}
        if name in EVENT_TYPES:
            chosen.add(name)
        elif family:
            chosen |= family
        else:
            known = ", ".join(sorted(EVENT_TYPES))
            raise ValueError(f"unknown event type {name!r}: the types are {known}")
    chosen.add("dropped")  # a filtered reader is still told what it lost
    return frozenset(chosen)
