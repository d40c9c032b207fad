"""`DashboardProcess`: `met serve --tui` runs the dashboard in a process of its own.

The server's event bus feeds it through a pipe, one JSON event per line, from a subscription
like any other reader's: bounded, so a dashboard that falls behind loses events and is told,
and the pipe's writer never blocks the event loop (past `MAX_PIPE_BUFFER` bytes waiting, events
are dropped). Whatever the dashboard does when its terminal goes away (textual can stall
there), the server's process is not in it: on SIGHUP the server kills the dashboard and goes on
serving. A dashboard that the user quit exits 0, and the server then stops, as on Ctrl+C.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection

from metrale.telemetry import events
from metrale.telemetry.bus import EventBus, Subscription

logger = logging.getLogger(__name__)

QUEUE_SIZE = 8192  # events the server holds for the dashboard
MAX_PIPE_BUFFER = 4 << 20  # bytes written but not yet read by the dashboard


class DashboardProcess:
    def __init__(self, bus: EventBus, title: str) -> None:
        self.bus, self.title = bus, title
        self.num_dropped = 0
        self._process: multiprocessing.process.BaseProcess | None = None
        self._feeder: asyncio.Task[None] | None = None

    async def run(self) -> bool:
        """Start the dashboard and feed it until it exits; True if the user quit it."""
        context = multiprocessing.get_context("spawn")
        # A plain pipe under multiprocessing's connections (which the spawned child can be
        # handed); the bytes on it are ours, one JSON event a line.
        reading, writing = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child_main, args=(reading, self.title), name="metrale-tui", daemon=True
        )
        self._process.start()
        reading.close()
        write_fd = os.dup(writing.fileno())
        writing.close()
        subscription = self.bus.subscribe(capacity=QUEUE_SIZE)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_write_pipe(
            asyncio.Protocol, os.fdopen(write_fd, "wb", buffering=0)
        )
        self._feeder = asyncio.create_task(self._feed(subscription, transport))
        try:
            while self._process.is_alive():
                await asyncio.sleep(0.2)
        finally:
            self._feeder.cancel()
            subscription.close()
            transport.close()
        return self._process.exitcode == 0

    async def _feed(self, subscription: Subscription, transport: asyncio.WriteTransport) -> None:
        async for event in subscription:
            if transport.is_closing():
                return
            if transport.get_write_buffer_size() > MAX_PIPE_BUFFER:
                self.num_dropped += 1
                continue
            transport.write(events.encode(event) + b"\n")

    def kill(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()


def _child_main(reading: Connection, title: str) -> None:
    """The dashboard process: events from the pipe, drawn in this terminal. Exit 0 when the
    user quits, 1 when the terminal is gone or the dashboard failed."""
    from metrale.tui.dashboard import run_dashboard

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # keys come through textual, not as signals
    signal.signal(signal.SIGHUP, lambda *_: os._exit(1))  # the terminal is gone: just go
    logging.basicConfig(level=logging.CRITICAL)  # nothing may print over the screen
    try:  # multiprocessing gave this process /dev/null for stdin: the keys come from the tty
        tty = os.open("/dev/tty", os.O_RDWR)
    except OSError:
        os._exit(1)
    os.dup2(tty, 0)
    os.close(tty)
    sys.stdin = sys.__stdin__ = os.fdopen(0, "r", closefd=False)

    async def main() -> bool:
        reader = asyncio.StreamReader(limit=1 << 24)
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader),
            os.fdopen(os.dup(reading.fileno()), "rb", buffering=0),
        )
        return await run_dashboard(_events(reader), title)

    quit_by_user = asyncio.run(main())
    os._exit(0 if quit_by_user else 1)  # without waiting on textual's threads


async def _events(reader: asyncio.StreamReader) -> AsyncIterator[events.Event]:
    while line := await reader.readline():
        with contextlib.suppress(Exception):  # a line it cannot read is skipped
            yield events.decode(line)
