"""The admission rules' state across several API processes (`--api-server-count`): the rate
limits and the queue bound hold for the server, whichever process a connection lands on.

- The rate limiter's buckets live in a SQLite file of this run's (`SharedRateLimiter`). Each
  charge, refund or header read is one transaction under the file's write lock (`BEGIN
  IMMEDIATE`): the client's row is read into the same `TokenBucket`s the in-process limiter
  keeps, changed and written back; a new row past `max_keys` evicts the least recently used. The
  buckets' times are `time.monotonic()`, which every process on the machine shares.
- The queue bound (`--max-queued-requests`) counts the requests waiting for a first token in
  every process (`WaitingSlots`): each process counts its own exactly and writes the count into
  its slot of an array in shared memory, at each of its admissions and every `REFRESH_S`; an
  admission adds the other slots, as fresh as their last write (so processes admitting in the
  same few milliseconds may together pass the bound by what they admitted in that time).

The first API process makes both (`SharedAdmission.create`) and removes the file at exit:
nothing in them outlives the server, as nothing in one process's tables does.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale.server.security.config import SecurityConfig
from metrale.server.security.guard import Guard
from metrale.server.security.rate_limiter import ClientBuckets, RateLimiter, TokenBucket


@dataclass(frozen=True)
class SharedAdmission:
    """What the API processes share of the admission rules (picklable into each at spawn)."""

    directory: Path  # holds the rate limiter's file
    waiting: Any  # a shared int64 array, a slot per API process

    @classmethod
    def create(cls, count: int) -> SharedAdmission:
        directory = Path(tempfile.mkdtemp(prefix="metrale-limits-"))
        return cls(directory, multiprocessing.get_context("spawn").RawArray("q", count))

    def guard(self, config: SecurityConfig, index: int) -> Guard:
        """Process `index`'s guard over the shared state."""
        limiter = None
        if config.rate_limit_rpm is not None or config.rate_limit_tpm is not None:
            limiter = SharedRateLimiter(
                self.directory / "rate_limits.db",
                config.rate_limit_rpm,
                config.rate_limit_tpm,
                config.rate_limit_max_keys,
            )
        waiting = WaitingSlots(self.waiting, index) if config.max_queued_requests else None
        return Guard(config, limiter=limiter, waiting=waiting)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


REFRESH_S = 0.01

SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets (
    client TEXT PRIMARY KEY,
    requests_level REAL, requests_updated REAL,
    tokens_level REAL, tokens_updated REAL,
    used REAL NOT NULL  -- the last charge: orders eviction
);
CREATE INDEX IF NOT EXISTS buckets_by_use ON buckets (used);
"""


class SharedRateLimiter(RateLimiter):
    """The rate limiter over the buckets of a SQLite file that other processes use too."""

    def __init__(
        self,
        path: Path,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(requests_per_minute, tokens_per_minute, max_keys, clock)
        # Autocommit: transactions are begun and ended here, explicitly.
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=OFF")  # this run's only: nothing to keep
        self._conn.executescript(SCHEMA)

    @property
    def num_clients(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM buckets").fetchone()[0]

    @contextlib.contextmanager
    def _use(self, client: str, now: float, create: bool = True) -> Iterator[ClientBuckets | None]:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute(
                "SELECT requests_level, requests_updated, tokens_level, tokens_updated "
                "FROM buckets WHERE client = ?",
                (client,),
            ).fetchone()
            if row is None and not create:
                yield None
                conn.execute("COMMIT")
                return
            buckets = self._new_buckets(now)
            if row is not None:
                for bucket, level, updated in (
                    (buckets.requests, row[0], row[1]),
                    (buckets.tokens, row[2], row[3]),
                ):
                    if bucket is not None and level is not None:
                        bucket.level, bucket.updated = level, updated
            yield buckets
            conn.execute(
                "INSERT INTO buckets VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (client) DO UPDATE SET "
                "requests_level = excluded.requests_level, "
                "requests_updated = excluded.requests_updated, "
                "tokens_level = excluded.tokens_level, tokens_updated = excluded.tokens_updated, "
                "used = CASE WHEN ? THEN excluded.used ELSE used END",
                (client, *_state(buckets.requests), *_state(buckets.tokens), now, create),
            )
            if row is None:
                conn.execute(
                    "DELETE FROM buckets WHERE client IN (SELECT client FROM buckets "
                    "ORDER BY used DESC LIMIT -1 OFFSET ?)",
                    (self.max_keys,),
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._conn.close()


def _state(bucket: TokenBucket | None) -> tuple[float | None, float | None]:
    return (None, None) if bucket is None else (bucket.level, bucket.updated)


class WaitingSlots:
    """This process's count of waiting requests in shared memory, and the others'."""

    def __init__(self, slots: Any, index: int) -> None:
        self.slots = slots
        self.index = index

    def publish(self, waiting: int) -> None:
        self.slots[self.index] = waiting

    def others(self) -> int:
        return sum(self.slots) - self.slots[self.index]

    async def keep_fresh(self, count: Callable[[], int]) -> None:
        """Write this process's count every `REFRESH_S` (a task of the serving process)."""
        while True:
            self.publish(count())
            await asyncio.sleep(REFRESH_S)
