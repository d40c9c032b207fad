"""The engine core's busy loop, as run in its own process (or thread) behind ZMQ sockets.

Each turn drains every message waiting on the input sockets (new requests, aborts), runs one
engine step if any request is unfinished, and sends the outputs with the KV pool's state. When
nothing is unfinished it blocks on the input sockets instead of spinning. It never waits on the
API processes: outputs are pushed, not requested. With several API processes
(`--api-server-count`) each has its own pair of sockets (`ApiLinks`).
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from collections import deque

import zmq

from metrale import envs
from metrale.engine.core import EngineCore
from metrale.engine.heap import freeze_startup_heap
from metrale.engine.messages import (
    EngineOutput,
    EngineRequest,
    Failed,
    KVCacheStats,
    MessageKind,
    Outputs,
    Ready,
    StepStats,
    decode,
    encode,
)
from metrale.engine.spawn import EngineSockets, EngineSpec
from metrale.engine.stats import DeviceMemoryReader, forward_info, kv_cache_stats
from metrale.engine_config import EngineConfig
from metrale.telemetry import logs

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle engine checks that its parent is still alive
BACKLOG_RETRY_MS = 10  # how often an idle engine retries a stalled API process's backlog


def run_engine_core(
    engine: EngineConfig | EngineSpec,
    sockets: EngineSockets,
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
            logs.write_output_to(log_file)
        logs.configure()  # in the format the API process was started with
    links = ApiLinks(context or zmq.Context(), sockets)
    core = None
    try:
        if isinstance(engine, EngineSpec):
            try:
                config = engine.resolve()
            except Exception as e:
                links.broadcast(MessageKind.FAILED, Failed(_one_line(e)))
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
            links.broadcast(MessageKind.FAILED, Failed(_one_line(e)))
            return
        freeze_startup_heap()  # or the busy loop's collections walk the model and the pool
        links.broadcast(MessageKind.READY, Ready(kv_cache_stats(core), forward_info(core)))
        _serve(core, links, parent_pid=None if in_process else os.getppid())
    except Exception:
        message = traceback.format_exc()
        logger.error("engine core died:\n%s", message)
        links.broadcast(MessageKind.FAILED, Failed(message))
        raise
    finally:
        if core is not None:
            core.shutdown()
        links.close()


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _exit_on_rank_death(reason: str) -> None:
    """A tensor-parallel rank died: the engine process exits at once, so the API process sees
    a dead engine (503s, a red /health) instead of a step waiting on a rank that is gone."""
    logger.error("%s: the engine core exits", reason)
    os._exit(1)


class ApiLinks:
    """The API processes an engine core serves: an input socket and an output socket each, in
    the order of `EngineSockets`. A request's outputs (and its refusal) go to the process that
    added it; every process gets the KV pool's state with each batch, and the first one, which
    reports the engine's own figures (`Telemetry`), the step statistics too.

    With several, a process that stops reading (stopped, swapping, stuck) must not stop the
    engine for the others: a send that would block (its socket's queue is full) is kept in that
    process's backlog instead, later batches merged into the last one kept (their outputs in
    order, the pool's latest state), and sent as soon as the process reads again (`flush`).
    One process alone is sent to blocking: waiting for it is all the engine could do."""

    def __init__(self, context: zmq.Context, sockets: EngineSockets) -> None:
        self.inputs, self.outputs = [], []
        self.poller = zmq.Poller()
        for client in range(sockets.num_clients):
            inputs = context.socket(zmq.PULL)
            inputs.connect(sockets.input(client))
            self.poller.register(inputs, zmq.POLLIN)
            self.inputs.append(inputs)
            outputs = context.socket(zmq.PUSH)
            outputs.connect(sockets.output(client))
            self.outputs.append(outputs)
        self.owner: dict[str, int] = {}  # request id -> its API process, with several
        # What could not be sent to each process yet: (kind, payload), oldest first.
        self.backlog: list[deque[tuple[MessageKind, object]]] = [deque() for _ in self.outputs]

    def receive(self, timeout_ms: int) -> list[tuple[int, MessageKind, object]]:
        """The messages waiting, each with the index of the API process that sent it; waits up
        to `timeout_ms` for the first when none is."""
        if len(self.inputs) == 1:
            inputs = self.inputs[0]
            if not inputs.poll(timeout_ms):
                return []
            return [(0, *decode(inputs.recv_multipart()))]
        ready = dict(self.poller.poll(timeout_ms))
        return [
            (client, *decode(inputs.recv_multipart()))
            for client, inputs in enumerate(self.inputs)
            if ready.get(inputs)
        ]

    def added(self, client: int, request_id: str) -> None:
        if len(self.outputs) > 1:
            self.owner.setdefault(request_id, client)  # (a duplicate id is refused)

    def send(
        self,
        outputs: list[EngineOutput],
        kv_cache: KVCacheStats,
        rejected: list[tuple[int, str, str]],
        steps: list[StepStats],
    ) -> None:
        """One batch: `rejected` holds (API process, request id, why) for the refused."""
        if len(self.outputs) == 1:
            message = Outputs(outputs, kv_cache, [(r, why) for _, r, why in rejected], steps)
            self.outputs[0].send_multipart(encode(MessageKind.OUTPUTS, message))
            return
        parts: list[list[EngineOutput]] = [[] for _ in self.outputs]
        refused: list[list[tuple[str, str]]] = [[] for _ in self.outputs]
        for output in outputs:
            owner = self.owner.get(output.request_id, 0)
            if output.finish_reason is not None:
                self.owner.pop(output.request_id, None)
            parts[owner].append(output)
        for client, request_id, reason in rejected:
            if self.owner.get(request_id) == client:
                del self.owner[request_id]
            refused[client].append((request_id, reason))
        for client in range(len(self.outputs)):
            own_steps = steps if client == 0 else []
            message = Outputs(parts[client], kv_cache, refused[client], own_steps)
            self._deliver(client, MessageKind.OUTPUTS, message)

    def broadcast(self, kind: MessageKind, payload: object) -> None:
        if len(self.outputs) == 1:
            self.outputs[0].send_multipart(encode(kind, payload))
            return
        for client in range(len(self.outputs)):
            self._deliver(client, kind, payload)

    @property
    def backlogged(self) -> bool:
        return any(self.backlog)

    def flush(self) -> None:
        """Send what each process's backlog holds, as far as its socket takes it now."""
        for client in range(len(self.outputs)):
            self._flush(client)

    def _flush(self, client: int) -> None:
        backlog = self.backlog[client]
        while backlog and self._try_send(client, *backlog[0]):
            backlog.popleft()

    def _deliver(self, client: int, kind: MessageKind, payload: object) -> None:
        backlog = self.backlog[client]
        self._flush(client)
        if not backlog and self._try_send(client, kind, payload):
            return
        if backlog and kind is MessageKind.OUTPUTS and backlog[-1][0] is MessageKind.OUTPUTS:
            kept = backlog[-1][1]
            assert isinstance(kept, Outputs) and isinstance(payload, Outputs)
            backlog[-1] = (kind, merged(kept, payload))
        else:
            backlog.append((kind, payload))

    def _try_send(self, client: int, kind: MessageKind, payload: object) -> bool:
        try:
            self.outputs[client].send_multipart(encode(kind, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.flush()
        for outputs in self.outputs:
            outputs.close(linger=1000)
        for inputs in self.inputs:
            inputs.close(linger=0)


def merged(kept: Outputs, then: Outputs) -> Outputs:
    """Two batches for one process as one: both batches' outputs, refusals and step figures in
    order, the pool's state after the second. `kept`'s lists (a backlog's own, built for that
    process alone) grow in place, so a long stall costs each step its own batch, not a copy of
    all that waits."""
    kept.outputs.extend(then.outputs)
    kept.rejected.extend(then.rejected)
    kept.steps.extend(then.steps)
    return Outputs(kept.outputs, then.kv_cache, kept.rejected, kept.steps)


def _serve(core: EngineCore, links: ApiLinks, parent_pid: int | None) -> None:
    memory = DeviceMemoryReader(core)
    while True:
        step_outputs: list[EngineOutput] = []
        rejected: list[tuple[int, str, str]] = []
        changed = False
        if links.backlogged:
            links.flush()
        timeout_ms = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
        if links.backlogged:  # come back soon to send it
            timeout_ms = min(timeout_ms, BACKLOG_RETRY_MS)
        while messages := links.receive(timeout_ms):
            timeout_ms = 0
            changed = True
            for client, kind, payload in messages:
                if kind is MessageKind.SHUTDOWN:
                    return
                if kind is MessageKind.ADD:
                    assert isinstance(payload, EngineRequest)
                    links.added(client, payload.request_id)
                    try:
                        core.add_request(payload)
                    except ValueError as e:
                        rejected.append((client, payload.request_id, str(e)))
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
            links.send(step_outputs, kv_cache_stats(core, memory.read()), rejected, steps)
