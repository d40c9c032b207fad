"""The API process's handle on the engine core: add, abort, and a stream of outputs.

The core runs in a child process (the server) or, for tests, in a thread of this process; both
speak the same ZMQ messages over IPC sockets, so nothing above this class can tell them apart.
The client notices a dead engine within `LIVENESS_POLL_MS` (its process exited, or it said
FAILED) and from then on raises `EngineDeadError` rather than waiting forever.

With several API processes (`--api-server-count`) the first launches the engine and owns it
(it alone stops it); each of the others `attach`es to it through its own pair of sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from metrale import envs
from metrale.engine.allocator import engine_process_allocator, engine_runs_on_cpu
from metrale.engine.messages import (
    EngineRequest,
    Failed,
    ForwardInfo,
    KVCacheStats,
    MessageKind,
    Outputs,
    Ready,
    decode,
    encode,
)
from metrale.engine.spawn import EngineSockets, EngineSpec, run_engine_process

if TYPE_CHECKING:
    from metrale.engine_config import EngineConfig

logger = logging.getLogger(__name__)

LIVENESS_POLL_MS = 200


class EngineDeadError(RuntimeError):
    pass


class EngineClient:
    config: EngineConfig  # as resolved, with the engine's KV pool size once it is ready

    def __init__(
        self,
        config: EngineConfig | None,
        worker: multiprocessing.process.BaseProcess | threading.Thread | EngineProcess,
        context: zmq.asyncio.Context,
        sockets: EngineSockets,
        client: int = 0,
    ) -> None:
        if config is not None:
            self.config = config  # else set by ready(): the engine resolves its own
        self._worker = worker
        self._context = context
        self.sockets = sockets
        self.client = client  # which of the engine's API processes this one is
        # This process's pair of sockets; it binds them, the engine connects.
        self._to_engine = to_engine = context.socket(zmq.PUSH)
        to_engine.bind(sockets.input(client))
        self._from_engine = from_engine = context.socket(zmq.PULL)
        from_engine.bind(sockets.output(client))
        # The same socket without asyncio's futures, for reading what has already arrived: a
        # batch a step at high rates, where a future and a raised `zmq.Again` per read cost.
        self._arrived = zmq.Socket.shadow(from_engine.underlying)
        self._dead_reason: str | None = None
        self.kv_cache: KVCacheStats | None = None
        self.forward: ForwardInfo | None = None  # what the engine said of its forward, at READY

    @classmethod
    async def start(
        cls, config: EngineConfig, *, in_process: bool = False, startup_timeout_s: float = 900.0
    ) -> EngineClient:
        """Launch the engine core and wait until it has loaded the model."""
        client = cls.launch(config, in_process=in_process)
        await client.ready(config, startup_timeout_s)
        return client

    @classmethod
    def launch(
        cls,
        engine: EngineConfig | EngineSpec,
        *,
        in_process: bool = False,
        api_server_count: int = 1,
    ) -> EngineClient:
        """Start the engine core without waiting for it: it loads the model while the caller
        goes on, until `ready()`. Given an `EngineSpec` the engine resolves the flags itself,
        and nothing here imports torch (`spawn.py`). `api_server_count`: the API processes
        the engine will serve, this one the first (the others `attach`)."""
        sockets = EngineSockets(Path(tempfile.mkdtemp(prefix="metrale-")), api_server_count)
        if isinstance(engine, EngineSpec):
            config = None
            tensor_parallel_size = engine.engine_args.tensor_parallel_size
            on_cpu = engine_runs_on_cpu(engine.engine_args.device)
        else:
            config = engine
            tensor_parallel_size = engine.model.tensor_parallel_size
            on_cpu = engine.device.type == "cpu"
        worker: multiprocessing.process.BaseProcess | threading.Thread
        if in_process:
            from metrale.engine.core_loop import run_engine_core

            worker = threading.Thread(
                target=run_engine_core,
                name="engine-core",
                daemon=True,
                args=(engine, sockets, None, True),
            )
        else:
            worker = multiprocessing.get_context("spawn").Process(
                target=run_engine_process,
                name="metrale-engine-core",
                # It starts the tensor-parallel ranks past 0 itself, which a daemonic process
                # may not; it exits when this process goes away either way (core_loop.py).
                daemon=tensor_parallel_size == 1,
                args=(engine, sockets),
            )
        with engine_process_allocator(not in_process and on_cpu and envs.tcmalloc()) as allocator:
            worker.start()
        if isinstance(worker, multiprocessing.process.BaseProcess):
            logger.info("engine core process %d started", worker.pid)
        if allocator != "glibc":
            logger.info("engine process allocator: %s", allocator)
        return cls(config, worker, zmq.asyncio.Context(), sockets)

    @classmethod
    def attach(cls, sockets: EngineSockets, client: int, engine_pid: int) -> EngineClient:
        """An API process past the first joins the engine that one launched, as its `client`th
        API process; `ready()` then waits for the engine as the first does."""
        return cls(None, EngineProcess(engine_pid), zmq.asyncio.Context(), sockets, client)

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None for an engine in a thread)."""
        return getattr(self._worker, "pid", None)

    async def ready(self, config: EngineConfig, startup_timeout_s: float = 900.0) -> None:
        """Wait until the engine has loaded the model (stopping it if that fails or times out).
        `config`: the flags as this process resolved them; the KV pool's size is the engine's."""
        try:
            # A stop asked for while the caller's startup ran without awaiting (Ctrl-C cancels
            # the main task) lands here, even with READY already waiting, which is read without
            # suspending; and `asyncio.timeout`, not `wait_for`, which on Python 3.11 returns a
            # result that completed as it was cancelled: either way Ctrl-C was lost and the
            # server went on to serve.
            await asyncio.sleep(0)
            async with asyncio.timeout(startup_timeout_s):
                ready = await self._wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        self.kv_cache = ready.kv_cache
        self.forward = ready.forward
        # On a GPU the engine sized its pool after loading; validation here needs the size.
        self.config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, num_blocks=ready.kv_cache.num_blocks)
        )

    async def _wait_ready(self) -> Ready:
        while True:
            kind, payload = await self._receive()
            if kind is MessageKind.READY:
                assert isinstance(payload, Ready)
                return payload

    @property
    def is_alive(self) -> bool:
        if self._dead_reason is None and not self._worker.is_alive():
            exitcode = getattr(self._worker, "exitcode", None)
            # (an attached client's engine is another process's child: its code is not known)
            code = "" if exitcode is None else f" (exit code {exitcode})"
            self._dead_reason = f"the engine core exited{code}"
        return self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return None if self.is_alive else self._dead_reason

    def add_request(self, request: EngineRequest) -> None:
        self._check_alive()
        self._to_engine.send_multipart(encode(MessageKind.ADD, request), copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive:
            self._to_engine.send_multipart(encode(MessageKind.ABORT, request_ids), copy=False)

    async def get_outputs(self) -> Outputs:
        """The next batch of outputs; raises EngineDeadError once the engine is gone."""
        while True:
            kind, payload = await self._receive()
            if kind is MessageKind.OUTPUTS:
                assert isinstance(payload, Outputs)
                self.kv_cache = payload.kv_cache
                return payload

    def ready_outputs(self) -> list[Outputs]:
        """The batches of outputs the engine has sent already, taken without waiting: a caller
        that fell behind handles them together. A FAILED among them ends the list (the next
        `get_outputs` raises with its reason)."""
        batches = []
        while self._dead_reason is None and (frames := self._take()) is not None:
            message = self._read(frames)
            if message is not None and message[0] is MessageKind.OUTPUTS:
                assert isinstance(message[1], Outputs)
                self.kv_cache = message[1].kv_cache
                batches.append(message[1])
        return batches

    async def _receive(self) -> tuple[MessageKind, object]:
        # Liveness is checked only once nothing is left to read: an engine that fails sends
        # FAILED and exits, and its reason must not be lost to a bare "exited".
        while True:
            if self._from_engine.closed:  # shut down
                raise EngineDeadError(self._dead_reason or "the engine core was shut down")
            if (frames := self._take()) is not None:
                message = self._read(frames)
                if message is not None:
                    return message
            elif not await self._from_engine.poll(LIVENESS_POLL_MS):
                self._check_alive()

    def _take(self) -> list | None:
        """The frames of the next message if one has arrived; None without waiting if not."""
        if self._from_engine.closed or not self._arrived.get(zmq.EVENTS) & zmq.POLLIN:
            return None
        return self._arrived.recv_multipart(zmq.NOBLOCK)

    def _read(self, frames: list) -> tuple[MessageKind, object] | None:
        """A message from the engine; None for FAILED, whose reason is kept for the error."""
        kind, payload = decode(frames)
        if kind is MessageKind.FAILED:
            assert isinstance(payload, Failed)
            self._dead_reason = f"the engine core failed: {payload.message}"
            return None
        return kind, payload

    async def _wait_exit(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._worker.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the engine to stop, then make sure it has (once: later calls do nothing). An
        attached client only lets go of it: the first API process stops it."""
        if self._to_engine.closed:
            return
        if isinstance(self._worker, EngineProcess):
            self._dead_reason = self._dead_reason or "this API process let go of the engine"
            self._to_engine.close(linger=0)
            self._from_engine.close(linger=0)
            self._context.term()
            return
        process = isinstance(self._worker, multiprocessing.process.BaseProcess)
        if process and self.forward is None:
            timeout_s = 0.0  # not READY yet: it reads no message until it is
        if self._worker.is_alive():
            self._to_engine.send_multipart(encode(MessageKind.SHUTDOWN, None))
            await self._wait_exit(timeout_s)
            if process and self._worker.is_alive():
                self._worker.terminate()  # it still runs its exit handlers (spawn.py)
                await self._wait_exit(5.0)
                if self._worker.is_alive():
                    self._worker.kill()
            if process:
                self._worker.join(1.0)
        self._dead_reason = self._dead_reason or "the engine core was shut down"
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._context.term()
        shutil.rmtree(self.sockets.directory, ignore_errors=True)


class EngineProcess:
    """An engine process that another process started, as an attached client watches it: alive
    while its id names a process that has not exited (a zombie, exited but not yet reaped by
    its parent, counts as exited)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        if not _PROC.exists():  # no /proc (macOS): whether the id is in use
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return True
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state not in (b"Z", b"X")


_PROC = Path("/proc/self/stat")
