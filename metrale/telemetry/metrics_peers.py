"""`/metrics` across several API processes (`--api-server-count`): one exposition, whichever
process answers the scrape.

Each API process keeps its own registry (requests, tokens and latencies of the streams it
serves; the first also the engine's own figures) and answers its peers on an IPC socket with its
exposition. A scrape gathers every peer's, parses them and adds up each series, so a counter or
histogram is the server's total and a gauge the sum of the processes' (the engine's gauges are
set in the first process only, so theirs is the engine's value). A peer that does not answer
within `PEER_TIMEOUT_MS` is left out of that scrape and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import zmq
import zmq.asyncio
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

PEER_TIMEOUT_MS = 2000


class MetricsPeers:
    """This API process's side: answer the peers' scrapes with `render()`, and gather theirs."""

    def __init__(
        self, directory: Path, index: int, count: int, render: Callable[[], bytes]
    ) -> None:
        self.directory, self.index, self.count, self.render = directory, index, count, render
        self._context = zmq.asyncio.Context()
        self._answering: asyncio.Task[None] | None = None

    def _address(self, index: int) -> str:
        return f"ipc://{self.directory}/metrics-{index}"

    def start(self) -> None:
        socket = self._context.socket(zmq.REP)
        socket.bind(self._address(self.index))
        self._answering = asyncio.create_task(self._answer(socket), name="metrics-peers")

    async def _answer(self, socket: zmq.asyncio.Socket) -> None:
        try:
            while True:
                await socket.recv()
                await socket.send(self.render())
        finally:
            socket.close(linger=0)

    async def gather(self) -> list[bytes]:
        """Every other process's exposition (those that answered in time)."""
        answers = await asyncio.gather(
            *(self._ask(i) for i in range(self.count) if i != self.index)
        )
        return [answer for answer in answers if answer is not None]

    async def _ask(self, index: int) -> bytes | None:
        socket = self._context.socket(zmq.REQ)
        try:
            socket.connect(self._address(index))
            await socket.send(b"metrics")
            if await socket.poll(PEER_TIMEOUT_MS, zmq.POLLIN):
                return await socket.recv()
            logger.warning("API process %d did not answer the metrics scrape in time", index)
            return None
        finally:
            socket.close(linger=0)

    async def close(self) -> None:
        if self._answering is not None:
            self._answering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._answering
        self._context.term()


def merge_expositions(texts: Iterable[bytes]) -> bytes:
    """Prometheus text expositions as one: each sample (name and labels) the sum of its values,
    the families in the order they first appear."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            sums = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                sums[key] = sums.get(key, 0.0) + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return generate_latest(_Families(list(families.values())))


class _Families:
    """What `generate_latest` writes out: parsed families, as a registry would collect them."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
