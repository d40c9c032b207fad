"""Requests on their way into the engine, so that a burst of them reaches it before the API
process frames the first ones' tokens.

The API process does two kinds of work on one core: reading requests (HTTP, validation,
templating, tokenizing: ~0.5-1 ms each) and framing the tokens of those already running (tens of
microseconds a token). asyncio runs its ready tasks in turn, so under a burst the requests still
being read get only the share of the core that the running streams leave, and every one of them
reaches the engine later; the run ends when the last one's tokens do (bench/server_offline.py
reports how a round's requests arrived). While requests are arriving, the output router holds the
engine's batches (up to `hold_s`, by default `HOLD_S`, at a time): they wait in the socket, and
each stream takes them later as one delta (`AsyncLLM.generate` coalesces), which also costs less
than a delta a step.

A request counts from when the server starts reading it (`arriving`, the server's middleware)
until it has added its engine request (`added`, from `AsyncLLM.generate`) or has ended without
one (a 400, a disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Iterator

# The longest the router holds outputs for arrivals at a time: what a burst can delay the
# tokens of streams already running, each time.
HOLD_S = 0.05


class _Arrival:
    __slots__ = ("_arrivals", "_pending")

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals = arrivals
        self._pending = True

    def end(self) -> None:
        if self._pending:
            self._pending = False
            self._arrivals._ended()


_current: contextvars.ContextVar[_Arrival | None] = contextvars.ContextVar(
    "metrale_arrival", default=None
)


class Arrivals:
    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self.pending = 0
        self._waiters: list[asyncio.Future[None]] = []

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """The request that the calling task reads counts as arriving until `added` or the end
        of this block."""
        arrival = _Arrival(self)
        self.pending += 1
        token = _current.set(arrival)
        try:
            yield
        finally:
            _current.reset(token)
            arrival.end()

    @staticmethod
    def added() -> None:
        """The calling task's request has added its engine request (the first of its `n`)."""
        arrival = _current.get()
        if arrival is not None:
            arrival.end()

    async def settled(self) -> None:
        """Return once no request is arriving, or after `hold_s`."""
        if not self.pending:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.hold_s):
                    await waiter
        finally:
            self._waiters.remove(waiter)

    def _ended(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)
