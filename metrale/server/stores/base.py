"""A bounded store of JSON records, and the rules of keeping that every backend shares.

A backend (`memory`, `sqlite`) keeps rows and answers a few primitive questions (which row was
touched least recently, where a row stands in creation order); `RecordStore` alone decides what
to keep: expiry, eviction, refusal and copying are written once, here.
"""

from __future__ import annotations

import abc
import json
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple


@dataclass(frozen=True)
class StoreLimits:
    """How much a store keeps; past a limit, the least recently used records go first."""

    max_entries: int = 10_000  # records across all kinds
    max_bytes: int = 512 * 2**20  # sum of the records' JSON sizes (utf-8 bytes)
    ttl_s: float | None = 30 * 86400  # a record untouched (not read or written) this long is gone

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"StoreLimits.max_entries is {self.max_entries}; it must be >= 1")
        if self.max_bytes < 1:
            raise ValueError(f"StoreLimits.max_bytes is {self.max_bytes}; it must be >= 1")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ValueError(
                f"StoreLimits.ttl_s is {self.ttl_s}; it must be > 0, or None to never expire"
            )


# A module constant rather than a call in each signature: one frozen instance shared by all.
DEFAULT_LIMITS = StoreLimits()


@dataclass(frozen=True)
class Page:
    records: list[dict[str, Any]]
    has_more: bool  # more records that `match` accepts follow the last one here


class Stamp(NamedTuple):
    """Which record a backend touched least recently, and when."""

    kind: str
    key: str
    touched_at_s: float


class RecordStore(abc.ABC):
    """Records (JSON objects) by kind and key, bounded by `limits`, least recently used first out.

    True whenever no call is in progress:
    - `len(self) <= limits.max_entries` and the records' JSON sizes sum to `<= limits.max_bytes`;
    - no record untouched for `limits.ttl_s` or longer is returned, listed or counted;
    - each touch (a get or a put) stamps its record with a time strictly later than every earlier
      stamp (the clock's reading, nudged forward a hair when the clock has not moved on), so the
      stamps alone order recency for eviction and date each record for expiry; the expired
      records are therefore always the least recent ones.
    Stored records are JSON text, so no caller holds an object the store keeps. Every public call
    holds one lock: a store may be shared by threads, but `list`'s `match` must not call it.
    """

    def __init__(self, limits: StoreLimits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._closed = False
        self._last_stamp_s = -math.inf  # a reopened backend sets its newest stored stamp

    # The public interface.

    def get(self, kind: str, key: str) -> dict[str, Any] | None:
        """A copy of the record, which becomes the most recent; None if absent or expired."""
        _check_names(kind, key)
        with self._operation() as now_s:
            body = self._read(kind, key)
            if body is None:
                return None
            self._touch(kind, key, self._stamp(now_s))
        return json.loads(body)

    def put(self, kind: str, key: str, record: dict[str, Any]) -> None:
        """Insert or replace the record, which becomes the most recent; then evict to the limits.

        A replaced record keeps its place in creation order. A record that is not a JSON-able
        dict is a TypeError; one larger than `limits.max_bytes` on its own is a ValueError, and
        then nothing is stored or evicted.
        """
        _check_names(kind, key)
        body, size = _encode(record)
        if size > self.limits.max_bytes:
            raise ValueError(
                f"the record is {size:,} bytes of JSON; the store keeps at most "
                f"{self.limits.max_bytes:,} bytes in all: store a smaller record"
            )
        with self._operation() as now_s:
            self._write(kind, key, body, size, self._stamp(now_s))
            self._evict()

    def delete(self, kind: str, key: str) -> bool:
        """Whether the record existed (an expired one did not)."""
        _check_names(kind, key)
        with self._operation():
            return self._remove(kind, key)

    def list(
        self,
        kind: str,
        *,
        limit: int = 20,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
        match: Callable[[dict[str, Any]], bool] | None = None,
    ) -> Page:
        """Up to `limit` records of `kind` that `match` accepts, in creation order, after `after`.

        `asc` is oldest first. `after` is a key of `kind` (a KeyError if there is none) and the
        page starts past it in the chosen order. Listing is not use: recency stays as it was.
        """
        if limit < 0:
            raise ValueError(f"limit is {limit}; it must be >= 0")
        if order not in ("asc", "desc"):
            raise ValueError(f"order is {order!r}; it must be 'asc' or 'desc'")
        with self._operation():
            after_seq = None
            if after is not None:
                after_seq = self._seq(kind, after)
                if after_seq is None:
                    raise KeyError(after)
            records: list[dict[str, Any]] = []
            has_more = False
            with closing(self._scan(kind, after_seq, descending=order == "desc")) as bodies:
                for body in bodies:
                    record = json.loads(body)
                    if match is not None and not match(record):
                        continue
                    if len(records) == limit:
                        has_more = True
                        break
                    records.append(record)
        return Page(records, has_more)

    def close(self) -> None:
        """Release the backend; any later call but `close` is a RuntimeError."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._close()

    def __len__(self) -> int:
        with self._operation():
            return self._num_entries()

    # The rules.

    @contextmanager
    def _operation(self) -> Iterator[float]:
        """Hold the lock, drop what expired, yield the clock's reading; commit, or roll back."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the record store is closed")
            try:
                self._begin()
                now_s = self._clock()
                self._expire(now_s)
                yield now_s
            except BaseException:
                self._rollback()
                raise
            self._commit()

    def _stamp(self, now_s: float) -> float:
        self._last_stamp_s = max(now_s, math.nextafter(self._last_stamp_s, math.inf))
        return self._last_stamp_s

    def _expire(self, now_s: float) -> None:
        if self.limits.ttl_s is None:
            return
        cutoff_s = now_s - self.limits.ttl_s
        while (oldest := self._least_recent()) is not None and oldest.touched_at_s <= cutoff_s:
            self._remove(oldest.kind, oldest.key)

    def _evict(self) -> None:
        # The record just put is the most recent and fits on its own, so this stops before it.
        limits = self.limits
        while self._num_entries() > limits.max_entries or self._num_bytes() > limits.max_bytes:
            oldest = self._least_recent()
            assert oldest is not None, "a store over its limits holds records"
            self._remove(oldest.kind, oldest.key)

    # What a backend answers. Called with the lock held, kinds and keys already checked.

    @abc.abstractmethod
    def _read(self, kind: str, key: str) -> str | None:
        """The record's JSON text, or None."""

    @abc.abstractmethod
    def _write(self, kind: str, key: str, body: str, size: int, touched_at_s: float) -> None:
        """Insert the row last in creation order, or replace it in place."""

    @abc.abstractmethod
    def _touch(self, kind: str, key: str, touched_at_s: float) -> None:
        """Restamp an existing row."""

    @abc.abstractmethod
    def _remove(self, kind: str, key: str) -> bool:
        """Delete the row; whether it was there."""

    @abc.abstractmethod
    def _least_recent(self) -> Stamp | None:
        """The row with the smallest stamp, or None when empty."""

    @abc.abstractmethod
    def _seq(self, kind: str, key: str) -> int | None:
        """The row's position in creation order (larger is newer), or None if absent."""

    @abc.abstractmethod
    def _scan(self, kind: str, after_seq: int | None, *, descending: bool) -> Iterator[str]:
        """Bodies of `kind` in creation order, past `after_seq`; closed when the caller is done."""

    @abc.abstractmethod
    def _num_entries(self) -> int: ...

    @abc.abstractmethod
    def _num_bytes(self) -> int: ...

    @abc.abstractmethod
    def _begin(self) -> None:
        """Start a call (a backend shared with other processes takes its lock and reads back
        what they changed)."""

    @abc.abstractmethod
    def _commit(self) -> None:
        """Make what this call wrote durable, all of it or none."""

    @abc.abstractmethod
    def _rollback(self) -> None:
        """Undo what a failed call wrote, where the backend can."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release what the backend holds."""


def _check_names(kind: str, key: str) -> None:
    # Both backends must agree: a str that SQLite could not bind (a lone surrogate) is refused
    # here rather than accepted by one backend and not the other.
    for what, name in (("kind", kind), ("key", key)):
        if not isinstance(name, str):
            raise TypeError(f"a record's {what} is a str, not {type(name).__name__}")
        try:
            name.encode()
        except UnicodeEncodeError:
            raise ValueError(
                f"the record's {what} {name!r} is not valid Unicode (a lone surrogate)"
            ) from None


def _encode(record: dict[str, Any]) -> tuple[str, int]:
    """The record's JSON text and its size in utf-8 bytes."""
    if not isinstance(record, dict):
        raise TypeError(f"a record is a JSON object (a dict), not {type(record).__name__}")
    body = json.dumps(record, ensure_ascii=False)
    try:
        return body, len(body.encode())
    except UnicodeEncodeError:
        raise ValueError(
            "the record holds text that is not valid Unicode (a lone surrogate)"
        ) from None
