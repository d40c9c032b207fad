"""Background responses across API processes (`--api-server-count`): a background response
runs in the process that took its POST, and any process answers for it.

The owner writes a record of the run (`OWNERS` in the shared record store: the server run's id
and its process index) as it starts the run and deletes it when the run ends; so another process
tells a running response from one orphaned by a restart (the run's id is this server's). Each
process answers its peers on a ROUTER socket: `cancel` stops a run it holds and says whether it
did, `follow` streams a run's events after a sequence number, as the owner's own `GET ?stream`
does, then `end`. An owner answers within milliseconds (a follow says `following` before its
events); one that does not within `PEER_TIMEOUT_S` is stopped or hung, and the asking request
gets a 503 (`PeerUnavailable`) instead of waiting on it for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from metrale.server.errors import APIError
from metrale.server.stores import RecordStore

logger = logging.getLogger(__name__)

OWNERS = "background_owner"  # the store's kind for who runs a background response
PEER_TIMEOUT_S = 5.0  # for an owner's first answer to a cancel or a follow


class PeerUnavailable(APIError):
    """The API process running a background response did not answer in time: a 503."""

    def __init__(self, owner: int) -> None:
        super().__init__(
            f"the API process running this response (process {owner}) did not answer in "
            f"{PEER_TIMEOUT_S:g} s; try again",
            503,
        )


class BackgroundPeers:
    def __init__(
        self,
        directory: Path,
        index: int,
        store: RecordStore,
        runs: dict[str, tuple[asyncio.Task, Any]],
    ) -> None:
        self.directory, self.index, self.store = directory, index, store
        self.run_id = directory.name  # this server's run: the engine sockets' directory
        self.runs = runs  # this process's background runs (ServerState.background)
        self._context = zmq.asyncio.Context()
        self._tasks: set[asyncio.Task[None]] = set()

    def _address(self, index: int) -> str:
        return f"ipc://{self.directory}/background-{index}"

    # -- the owner's side --------------------------------------------------------------------

    def started(self, response_id: str) -> None:
        self.store.put(OWNERS, response_id, {"run": self.run_id, "process": self.index})

    def ended(self, response_id: str) -> None:
        self.store.delete(OWNERS, response_id)

    def start(self) -> None:
        self._router = self._context.socket(zmq.ROUTER)
        self._router.bind(self._address(self.index))
        self._spawn(self._answer())

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self) -> None:
        while True:
            peer, op, response_id, *rest = await self._router.recv_multipart()
            if op == b"cancel":
                self._spawn(self._cancel(peer, response_id.decode()))
            elif op == b"follow":
                self._spawn(self._follow(peer, response_id.decode(), int(rest[0])))

    async def _cancel(self, peer: bytes, response_id: str) -> None:
        stopped = await stop_run(self.runs, response_id)
        await self._router.send_multipart([peer, b"done", b"1" if stopped else b"0"])

    async def _follow(self, peer: bytes, response_id: str, after: int) -> None:
        await self._router.send_multipart([peer, b"following", b""])
        live = self.runs.get(response_id)
        if live is not None:
            async for event in live[1].follow(after):
                await self._router.send_multipart([peer, b"event", json.dumps(event).encode()])
        await self._router.send_multipart([peer, b"end", b""])

    # -- another process's side --------------------------------------------------------------

    def owner(self, response_id: str) -> int | None:
        """The process running `response_id` in this server, or None (not running)."""
        record = self.store.get(OWNERS, response_id)
        if record is None or record.get("run") != self.run_id:
            return None
        return int(record["process"])

    def _dealer(self, owner: int) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.connect(self._address(owner))
        return socket

    async def _answer_of(self, socket: zmq.asyncio.Socket, owner: int) -> list[bytes]:
        try:
            async with asyncio.timeout(PEER_TIMEOUT_S):  # (wait_for can lose a cancel on 3.11)
                return await socket.recv_multipart()
        except TimeoutError:
            raise PeerUnavailable(owner) from None

    async def cancel(self, owner: int, response_id: str) -> bool:
        """Whether the owner stopped the run; `PeerUnavailable` if it does not answer."""
        socket = self._dealer(owner)
        try:
            await socket.send_multipart([b"cancel", response_id.encode()])
            _, stopped = await self._answer_of(socket, owner)
        finally:
            socket.close(linger=0)
        return stopped == b"1"

    async def follow(self, owner: int, response_id: str, after: int) -> AsyncIterator[Any]:
        """The run's events after `after`, once the owner has answered (`PeerUnavailable`
        before any event if it does not)."""
        socket = self._dealer(owner)
        try:
            await socket.send_multipart([b"follow", response_id.encode(), str(after).encode()])
            await self._answer_of(socket, owner)  # "following"
        except BaseException:
            socket.close(linger=0)
            raise
        return self._events(socket)

    @staticmethod
    async def _events(socket: zmq.asyncio.Socket) -> AsyncIterator[Any]:
        try:
            while True:
                kind, body = await socket.recv_multipart()
                if kind == b"end":
                    return
                yield json.loads(body)
        finally:
            socket.close(linger=0)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._router.close(linger=0)
        self._context.term()


async def stop_run(runs: dict[str, tuple[asyncio.Task, Any]], response_id: str) -> bool:
    """Cancel a background run of this process and wait until it has stopped; whether it ran."""
    live = runs.get(response_id)
    if live is None:
        return False
    task = live[0]
    task.cancel()
    await asyncio.wait([task])
    return True
