"""Records in this process's memory, gone when it exits."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from metrale.server.stores.base import DEFAULT_LIMITS, RecordStore, Stamp, StoreLimits


@dataclass(slots=True)
class _Row:
    body: str  # JSON text: a get parses a fresh copy, so no caller reaches what is stored
    size: int
    seq: int
    touched_at_s: float


class MemoryStore(RecordStore):
    """The same rows in two orders: least recently touched first, and per kind by creation.

    A dict keeps insertion order and a replaced value keeps its place, which is exactly
    creation order with "a replaced record keeps its place".
    """

    def __init__(
        self, limits: StoreLimits = DEFAULT_LIMITS, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(limits, clock)
        self._by_recency: OrderedDict[tuple[str, str], _Row] = OrderedDict()
        self._by_kind: dict[str, dict[str, _Row]] = {}
        self._total_bytes = 0
        self._next_seq = 0

    def _read(self, kind: str, key: str) -> str | None:
        row = self._by_recency.get((kind, key))
        return None if row is None else row.body

    def _write(self, kind: str, key: str, body: str, size: int, touched_at_s: float) -> None:
        row = self._by_recency.get((kind, key))
        if row is None:
            row = _Row(body, size, self._next_seq, touched_at_s)
            self._next_seq += 1
            self._by_recency[kind, key] = row
            self._by_kind.setdefault(kind, {})[key] = row
        else:
            self._total_bytes -= row.size
            row.body, row.size, row.touched_at_s = body, size, touched_at_s
            self._by_recency.move_to_end((kind, key))
        self._total_bytes += size

    def _touch(self, kind: str, key: str, touched_at_s: float) -> None:
        self._by_recency[kind, key].touched_at_s = touched_at_s
        self._by_recency.move_to_end((kind, key))

    def _remove(self, kind: str, key: str) -> bool:
        row = self._by_recency.pop((kind, key), None)
        if row is None:
            return False
        rows = self._by_kind[kind]
        del rows[key]
        if not rows:
            del self._by_kind[kind]
        self._total_bytes -= row.size
        return True

    def _least_recent(self) -> Stamp | None:
        for (kind, key), row in self._by_recency.items():
            return Stamp(kind, key, row.touched_at_s)
        return None

    def _seq(self, kind: str, key: str) -> int | None:
        row = self._by_recency.get((kind, key))
        return None if row is None else row.seq

    def _scan(self, kind: str, after_seq: int | None, *, descending: bool) -> Iterator[str]:
        rows = self._by_kind.get(kind, {}).values()
        for row in reversed(rows) if descending else rows:
            if after_seq is None or (row.seq < after_seq if descending else row.seq > after_seq):
                yield row.body

    def _num_entries(self) -> int:
        return len(self._by_recency)

    def _num_bytes(self) -> int:
        return self._total_bytes

    def _begin(self) -> None:
        pass  # one process's

    def _commit(self) -> None:
        pass  # each write above is already whole and visible

    def _rollback(self) -> None:
        pass  # nothing between two writes can fail halfway, so there is nothing to undo

    def _close(self) -> None:
        self._by_recency.clear()
        self._by_kind.clear()
        self._total_bytes = 0
