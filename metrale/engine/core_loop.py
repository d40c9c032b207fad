"""The engine core's busy loop, as run in its own process (or thread) behind ZMQ sockets.

Each turn drains every message waiting on the input socket (new requests, aborts), runs one
engine step if any request is unfinished, and sends the outputs with the KV pool's state. When
nothing is unfinished it blocks on the input socket instead of spinning. It never waits on the
API process: outputs are pushed, not requested.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import traceback

import zmq

from metrale import envs
from metrale.engine.core import EngineCore
from metrale.engine.messages import (
    EngineOutput,
    EngineRequest,
    Failed,
    MessageKind,
    Outputs,
    Ready,
    decode,
    encode,
)
from metrale.engine.spawn import EngineSpec
from metrale.engine.stats import forward_info, kv_cache_stats
from metrale.engine_config import EngineConfig
from metrale.telemetry import logs

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle engine checks that its parent is still alive


def run_engine_core(
    engine: EngineConfig | EngineSpec,
    input_addr: str,
    output_addr: str,
    context: zmq.Context | None = None,
    in_process: bool = False,
) -> None:
    """Build the engine, report READY (or FAILED), then serve until SHUTDOWN.

    Given an `EngineSpec`, the engine resolves its config first. The API process makes the same
    checks for itself and reports what fails them, so a failure there is only said in FAILED
    (which the API process reads if its own checks passed), not logged twice."""
    if not in_process:
        # The API process owns Ctrl-C and SIGTERM and shuts the engine down by message.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if (log_file := envs.engine_log_file()) is not None:  # the terminal is the TUI's
            log_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
        logs.configure()  # in the format the API process was started with
    context = context or zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_addr)
    core = None
    try:
        if isinstance(engine, EngineSpec):
            try:
                config = engine.resolve()
            except Exception as e:
                outputs.send_multipart(encode(MessageKind.FAILED, Failed(_one_line(e))))
                return
        else:
            config = engine
        try:
            core = EngineCore.from_config(
                config,
                progress=not in_process,
                on_rank_death=None if in_process else _exit_on_rank_death,
            )
        except Exception as e:
            logger.exception("engine core failed to start")
            outputs.send_multipart(encode(MessageKind.FAILED, Failed(_one_line(e))))
            return
        # Everything built so far (the block pool's tens of thousands of blocks, the model)
        # lives as long as the engine: keep it out of the garbage collector's sweeps, which
        # would otherwise walk it again and again from inside the busy loop.
        gc.freeze()
        outputs.send_multipart(
            encode(MessageKind.READY, Ready(kv_cache_stats(core), forward_info(core)))
        )
        _serve(core, inputs, outputs, parent_pid=None if in_process else os.getppid())
    except Exception:
        message = traceback.format_exc()
        logger.error("engine core died:\n%s", message)
        outputs.send_multipart(encode(MessageKind.FAILED, Failed(message)))
        raise
    finally:
        if core is not None:
            core.shutdown()
        outputs.close(linger=1000)
        inputs.close(linger=0)


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _exit_on_rank_death(reason: str) -> None:
    """A tensor-parallel rank died: the engine process exits at once, so the API process sees
    a dead engine (503s, a red /health) instead of a step waiting on a rank that is gone."""
    logger.error("%s: the engine core exits", reason)
    os._exit(1)


def _serve(
    core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int | None
) -> None:
    while True:
        step_outputs: list[EngineOutput] = []
        rejected: list[tuple[str, str]] = []
        changed = False
        timeout_ms = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
        while inputs.poll(timeout_ms):
            timeout_ms = 0
            changed = True
            kind, payload = decode(inputs.recv_multipart())
            if kind is MessageKind.SHUTDOWN:
                return
            if kind is MessageKind.ADD:
                assert isinstance(payload, EngineRequest)
                try:
                    core.add_request(payload)
                except ValueError as e:
                    rejected.append((payload.request_id, str(e)))
            elif kind is MessageKind.ABORT:
                assert isinstance(payload, list)
                for request_id in payload:
                    if (aborted := core.abort_request(request_id)) is not None:
                        step_outputs.append(aborted)
        if parent_pid is not None and os.getppid() != parent_pid:
            logger.warning("the API process is gone; engine core exiting")
            return
        if core.has_unfinished_requests():
            step_outputs.extend(core.step())
            changed = True
        if changed:
            steps = list(core.step_stats)
            core.step_stats.clear()
            message = Outputs(step_outputs, kv_cache_stats(core), rejected, steps)
            outputs.send_multipart(encode(MessageKind.OUTPUTS, message))
