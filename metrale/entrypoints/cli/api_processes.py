"""`met serve --api-server-count N`: the API processes past the first.

One API process detokenizes, frames and writes every stream, and at a few hundred concurrent
streams on a fast GPU it is the server's bound (issue 24's B4). With N, the process `met serve`
runs in (the first) binds the listening socket before anything else and launches the engine
(each data-parallel core), then starts N - 1 more: each is given the socket (all of them accept
on it, and the kernel hands each connection to one), its own pair of each core's sockets
(`EngineSockets`) and the flags. Each builds its own tokenizer, app and telemetry, waits for
the engine as the first does, and serves. The first alone reports the engine's own figures
(`Telemetry.reports_engine`); `/metrics` on any of them adds every process's series up
(`MetricsPeers`); the record store is one SQLite file they share (a temporary one for
`--response-store memory`).

The first stops the others (SIGTERM, then their graceful shutdown) before it stops the engine.
One that exits unasked takes the server down, so an orchestrator restarts it whole; one whose
parent is gone stops itself. Under data parallelism each process routes its own requests over
the cores. The event bus reaches across them (`EventPeers`): `/v1/events` on any process and
the dashboard see every process's requests; the rate limits and the queue bound hold across them
(`shared_admission.py`); a background response runs in the process that took it, and the
others reach it there (`background_peers.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from metrale.engine.spawn import EngineSockets

if TYPE_CHECKING:
    from metrale.engine.client import EngineClient
    from metrale.server.security.shared_admission import SharedAdmission

logger = logging.getLogger("metrale.serve")

STOP_TIMEOUT_S = 8.0  # past uvicorn's graceful shutdown (5 s), then a kill
PARENT_POLL_S = 0.5


def check_api_server_count(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, what several API processes cannot run with."""
    if args.api_server_count > 1 and args.engine_in_thread:
        raise SystemExit(
            f"met serve: --api-server-count {args.api_server_count}: not with "
            "--engine-in-thread (the other API processes reach the engine in its own process)"
        )


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (a port in use is an error before the model loads) but not
    listening: connections are refused until the first API process serves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"met serve: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class ApiProcessSpec:
    """What an API process past the first starts from (pickled into it; the socket's descriptor
    travels with it)."""

    args: argparse.Namespace
    model_dir: Path
    engines: list[tuple[EngineSockets, int]]  # each engine core's sockets and process id
    index: int
    parent_pid: int
    listener: socket.socket
    admission: SharedAdmission  # the rate limits' and the queue bound's shared state


class ApiProcesses:
    """The API processes past the first, as the first sees them."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess], serving: list) -> None:
        self.processes = processes
        self._serving = serving  # an Event each, set once that process serves
        self._stopping = False

    @classmethod
    def start(
        cls,
        args: argparse.Namespace,
        model_dir: Path,
        engines: list[EngineClient],
        listener: socket.socket,
        admission: SharedAdmission,
    ) -> ApiProcesses:
        """Start them; `engines`: the engine (every data-parallel core), launched."""
        cores = []
        for engine in engines:
            assert engine.engine_pid is not None, "an engine in a thread serves one process"
            cores.append((engine.sockets, engine.engine_pid))
        context = multiprocessing.get_context("spawn")
        processes, serving = [], []
        for index in range(1, engines[0].sockets.num_clients):
            spec = ApiProcessSpec(args, model_dir, cores, index, os.getpid(), listener, admission)
            event = context.Event()
            process = context.Process(
                target=run_api_process,
                name=f"metrale-api-{index}",
                args=(spec, event),
                daemon=True,
            )
            process.start()
            processes.append(process)
            serving.append(event)
        logger.info(
            "%d more API process%s started (pid %s)",
            len(processes),
            "es" if len(processes) > 1 else "",
            ", ".join(str(p.pid) for p in processes),
        )
        return cls(processes, serving)

    def dead(self) -> str | None:
        """Why the server must stop: an API process that exited unasked (None while all run)."""
        if self._stopping:
            return None
        for index, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                return f"API process {index} exited (exit code {process.exitcode})"
        return None

    async def wait_serving(self) -> None:
        """Until every one serves; raises RuntimeError if one exits first."""
        while not all(event.is_set() for event in self._serving):
            if (reason := self.dead()) is not None:
                raise RuntimeError(reason)
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """SIGTERM to each (their graceful shutdown), then a kill for any still running."""
        self._stopping = True
        for process in self.processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for process in self.processes:
            if process.is_alive():
                logger.warning("API process %s did not stop: killed", process.name)
                process.kill()
            process.join(1.0)


def run_api_process(spec: ApiProcessSpec, serving: object) -> None:
    """An API process past the first: the server around the engine the first launched, on the
    socket the first bound. Ctrl-C reaches the first, which stops this one by SIGTERM."""
    from metrale import envs
    from metrale.engine.client import EngineDeadError
    from metrale.entrypoints.cli.serve import _event_loop_factory
    from metrale.telemetry import logs

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal is the first's (the dashboard's)
    if (log_file := envs.engine_log_file()) is not None:  # the terminal is the dashboard's
        logs.write_output_to(log_file)
    logs.configure()
    # The first process tells the startup; this one logs its requests and what goes wrong.
    for name in ("metrale.serve", "metrale.entrypoints", "metrale.demo"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
            code = runner.run(_serve(spec, serving))
    except asyncio.CancelledError:  # SIGTERM before it served
        code = 0
    except EngineDeadError as e:  # it failed to start (the first process says why)
        logger.warning("API process %d: %s", spec.index, e)
        code = 1
    sys.exit(code)


async def _serve(spec: ApiProcessSpec, serving: object) -> int:
    from metrale.engine.client import EngineClient
    from metrale.engine_args import EngineArgs
    from metrale.entrypoints.cli.serve import open_record_store
    from metrale.entrypoints.cli.startup import Startup
    from metrale.server.security.config import SecurityConfig
    from metrale.telemetry.bus import EventBus

    main = asyncio.current_task()
    assert main is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, main.cancel)  # (serving, the server's handler)
    watch = asyncio.create_task(_exit_without_parent(spec.parent_pid))
    args = spec.args
    store = open_record_store(args)
    bus = EventBus()
    bus.bind_loop()
    startup = Startup(
        args,
        EngineArgs.from_cli(args),
        SecurityConfig.from_cli(args),
        bus,
        store,
        spec.model_dir,
        api_process=spec.index,
        admission=spec.admission,
    )
    cores = [EngineClient.attach(sockets, spec.index, pid) for sockets, pid in spec.engines]
    try:
        return await startup.run(
            cores[0] if len(cores) == 1 else cores,
            listener=spec.listener,
            on_serving=serving.set,  # type: ignore[attr-defined]
        )
    finally:
        watch.cancel()
        store.close()


async def _exit_without_parent(parent_pid: int) -> None:
    """The first API process gone (killed), this one stops too."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    logger.warning("the first API process is gone: stopping")
    signal.raise_signal(signal.SIGTERM)
