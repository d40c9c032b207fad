"""`AsyncLLM`: the API process's engine, streaming completion deltas to many callers at once.

Each `generate()` call gets a queue; one output task reads the engine client's output batches
and routes every delta to its request's queue. A caller that stops iterating (the HTTP client
went away) aborts its request, so its KV blocks are freed at the engine's next step. If the
engine dies, every open stream ends with `EngineDeadError`.

With a stream interval of N (`met serve --stream-interval`, as vLLM's and SGLang's), the router
holds a request's deltas until N tokens have gathered: a caller wakes, and a stream frames and
writes an event, once per N tokens instead of once per token. The first delta and the last go
at once, and so does anything that ends the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from metrale.engine.client import EngineClient, EngineDeadError
from metrale.engine.data_parallel_client import DataParallelClient
from metrale.engine.messages import EngineRequest, Outputs
from metrale.frontend.output_processor import CompletionDelta, OutputProcessor
from metrale.telemetry.hub import Telemetry
from metrale.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class RequestRejectedError(ValueError):
    """The engine refused a request (it never ran); the message says why."""


class AsyncLLM:
    def __init__(
        self,
        client: EngineClient | DataParallelClient,
        tokenizer: Tokenizer,
        telemetry: Telemetry | None = None,
        stream_interval: int = 1,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"the stream interval must be at least 1 token, got {stream_interval}")
        self.client = client
        self.stream_interval = stream_interval
        self.telemetry = telemetry or Telemetry(None)
        self.config = client.config
        self.tokenizer = tokenizer
        self._processor = OutputProcessor(tokenizer)
        self._queues: dict[str, asyncio.Queue[CompletionDelta | Exception]] = {}
        self._waiting: set[str] = set()  # added, no output yet: queued or in prefill
        # Requests whose deltas the stream interval gathers, with what is held back for each
        # (None: nothing since the last delivery).
        self._held: dict[str, CompletionDelta | None] = {}
        self._output_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._output_task = asyncio.create_task(self._route_outputs(), name="route-outputs")

    @property
    def is_alive(self) -> bool:
        return self.client.is_alive

    @property
    def num_waiting(self) -> int:
        """Requests sent to the engine that have had no output yet (queued, or in prefill)."""
        return len(self._waiting)

    async def generate(
        self, request: EngineRequest, api: str = "unknown", coalesce: bool = True
    ) -> AsyncIterator[CompletionDelta]:
        """Stream the request's deltas until it finishes; abort it if the caller leaves early.
        `api` names the route that asked, for the telemetry. A caller that leaves after marking
        the last delta it took finished (a stop only the API sees) ended the request with that
        finish reason: the telemetry counts it so, not as an abort.

        With `coalesce`, the deltas that queued while the caller was busy come as one: a server
        that falls behind its engine then frames one event per stream per turn, not one per
        engine step, and catches up instead of falling further behind."""
        request_id = request.request_id
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue[CompletionDelta | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        self._processor.add_request(
            request_id, len(request.prompt_token_ids), request.sampling_params
        )
        finished = False
        item: CompletionDelta | Exception | None = None
        try:
            self.client.add_request(request)
            if coalesce and self.stream_interval > 1:
                self._held[request_id] = None
            self.telemetry.request_added(request, api)
            self._waiting.add(request_id)
            item = await queue.get()
            self._waiting.discard(request_id)  # once, not on every delta
            while True:
                if isinstance(item, Exception):
                    finished = True
                    raise item
                after = _merge_queued(item, queue) if coalesce else None
                finished = item.finished
                yield item
                if finished:
                    break
                item = after if after is not None else await queue.get()
        finally:
            self._waiting.discard(request_id)
            self._queues.pop(request_id, None)
            self._held.pop(request_id, None)
            self._processor.remove_request(request_id)
            ended = item if isinstance(item, CompletionDelta) and item.finished else None
            self.telemetry.request_closed(request_id, ended)  # if it did not finish: an abort
            if not finished:
                self.client.abort_requests([request_id])

    async def _route_outputs(self) -> None:
        try:
            while True:
                # Every batch that has come in goes to its callers before they run again, so
                # one that fell behind takes its backlog in one turn (`generate`'s coalescing).
                batches = [await self.client.get_outputs(), *self.client.ready_outputs()]
                now = time.monotonic()
                for batch in batches:
                    self._route(batch, now)
        except EngineDeadError as e:
            logger.error("%s; failing %d open requests", e, len(self._queues))
            for request_id in list(self._queues):
                self._deliver(request_id, e)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not leave every caller waiting forever
            logger.exception("output routing failed")
            for request_id in list(self._queues):
                self._deliver(request_id, EngineDeadError("the output router failed"))
            raise

    def _route(self, batch: Outputs, now: float) -> None:
        for request_id, message in batch.rejected:
            self._deliver(request_id, RequestRejectedError(message))
        deltas: list[CompletionDelta] = []
        timings = {}  # the engine's milestones, with each request's first output
        for output in batch.outputs:
            delta = self._processor.process(output)
            if delta is None:
                continue
            if delta.abort_in_engine:
                self.client.abort_requests([delta.request_id])
            if output.timing is not None:
                timings[delta.request_id] = output.timing
            deltas.append(delta)
            if delta.request_id in self._held:
                self._gather(delta, first=output.timing is not None)
            else:
                self._deliver(delta.request_id, delta)
        # (The callers run once the router yields: the telemetry sees every delta first.)
        self.telemetry.deltas(deltas, timings, now)
        self.telemetry.engine_outputs(batch, now)

    def _gather(self, delta: CompletionDelta, first: bool) -> None:
        """Hold `delta` back under the stream interval, or hand over what has gathered: the
        request's first output (the engine sends its timing with it), the interval's tokens,
        and whatever ends the request go at once."""
        request_id = delta.request_id
        held = self._held[request_id]
        if held is not None:
            held.extend(delta)
            delta = held
        ends = delta.finished or delta.abort_in_engine
        if not (first or ends) and len(delta.token_ids) < self.stream_interval:
            self._held[request_id] = delta
            return
        self._held[request_id] = None
        self._deliver(request_id, delta)

    def _deliver(self, request_id: str, item: CompletionDelta | Exception) -> None:
        if isinstance(item, Exception) and (held := self._held.get(request_id)) is not None:
            self._held[request_id] = None
            self._deliver(request_id, held)  # what came before the error goes out first
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineDeadError):
                await self._output_task
        await self.client.shutdown()


def _merge_queued(
    delta: CompletionDelta, queue: asyncio.Queue[CompletionDelta | Exception]
) -> Exception | None:
    """Fold the deltas waiting in `queue` into `delta`, up to its last; an error met on the way
    is returned, to be raised once `delta` has gone out."""
    while not delta.finished and not queue.empty():
        later = queue.get_nowait()
        if isinstance(later, Exception):
            return later
        delta.extend(later)
    return None
