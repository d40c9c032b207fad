"""What an engine core's process starts from, importable without torch.

`met serve` starts the engine process as soon as it has read its flags and found the
checkpoint, before the API process imports torch, so that the two interpreters' imports (each
several seconds with CUDA's torch) run side by side instead of one after the other. The process
is given an `EngineSpec`, the flags and the checkpoint, and resolves them itself with the same
`EngineArgs.create_config` the API process calls for its own copy of the config.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from metrale.engine_args import EngineArgs

if TYPE_CHECKING:
    from metrale.engine_config import EngineConfig


@dataclass(frozen=True)
class EngineSockets:
    """Where an engine core and the API processes it serves meet: a directory of IPC sockets, an
    input and an output for each API process (`--api-server-count`; the first is the one that
    started the engine). Each API process binds its own pair; the engine connects to all."""

    directory: Path
    num_clients: int = 1

    def input(self, client: int) -> str:
        return f"ipc://{self.directory}/input-{client}"

    def output(self, client: int) -> str:
        return f"ipc://{self.directory}/output-{client}"


@dataclass(frozen=True)
class EngineSpec:
    """An engine core to be: the flags as typed, the checkpoint they were resolved to, and which
    data-parallel core it is."""

    engine_args: EngineArgs
    model_dir: Path
    data_parallel_rank: int = 0

    def resolve(self) -> EngineConfig:
        """The config, after the checks the API process makes before it waits on the engine
        (the flags resolved, the checkpoint's headers read), made the same way: what fails
        here, the API process reports itself."""
        from metrale.runner.model_loader import preflight_model

        config = self.engine_args.create_config(self.model_dir)
        preflight_model(self.model_dir, config.load_format)
        return config.for_core(self.data_parallel_rank) if config.data_parallel_size > 1 else config


def run_engine_process(engine: EngineConfig | EngineSpec, sockets: EngineSockets) -> None:
    """The engine process's target: pickled by name, so its module must import no torch.

    Once the engine has stopped (its ranks, sockets and logs closed) and the exit handlers have
    run (multiprocessing's finalizers, logging's flush), the process ends without the rest of
    the interpreter's teardown: that only frees what the OS frees anyway, and in it nanobind
    (Triton's bindings, which torch.compile and the GPU kernels load) prints a "leaked
    instances" report on every Ctrl-C."""
    # Stopped while it starts (the API process's Ctrl-C, or a flag it refused), it still
    # runs the exit handlers below: a terminate() mid-import must not leak a semaphore.
    signal.signal(signal.SIGTERM, _stop)
    code = 1  # run_engine_core logged the failure
    try:
        from metrale.engine.core_loop import run_engine_core

        run_engine_core(engine, sockets)
        code = 0
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
