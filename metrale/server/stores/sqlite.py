"""Records in a SQLite file, which outlive the process: a restart finds them as they were."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from metrale.server.stores.base import DEFAULT_LIMITS, RecordStore, Stamp, StoreLimits

SCHEMA_VERSION = 2  # PRAGMA user_version of a file this module wrote (1: before `totals`)
SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY,  -- creation order; an upsert that replaces a row keeps it
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    body TEXT NOT NULL,  -- the record's JSON
    size INTEGER NOT NULL,  -- utf-8 bytes of body
    touched_at REAL NOT NULL,  -- the store's stamp: orders recency and dates expiry
    UNIQUE (kind, key)
);
CREATE INDEX IF NOT EXISTS records_by_kind_seq ON records (kind, seq);
CREATE INDEX IF NOT EXISTS records_by_touched_at ON records (touched_at);
-- The row count and byte total, kept by the triggers in the writes' own transactions: a
-- process that shares the file reads them back in one row, not a scan of every record.
CREATE TABLE IF NOT EXISTS totals (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    num_rows INTEGER NOT NULL,
    num_bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals SELECT 0, COUNT(*), TOTAL(size) FROM records;
CREATE TRIGGER IF NOT EXISTS totals_on_insert AFTER INSERT ON records BEGIN
    UPDATE totals SET num_rows = num_rows + 1, num_bytes = num_bytes + NEW.size;
END;
CREATE TRIGGER IF NOT EXISTS totals_on_delete AFTER DELETE ON records BEGIN
    UPDATE totals SET num_rows = num_rows - 1, num_bytes = num_bytes - OLD.size;
END;
CREATE TRIGGER IF NOT EXISTS totals_on_resize AFTER UPDATE OF size ON records BEGIN
    UPDATE totals SET num_bytes = num_bytes - OLD.size + NEW.size;
END;
"""
SCAN_BATCH = 64  # rows fetched at a time while listing: a page rarely needs more


class SqliteStore(RecordStore):
    """One connection, one writer: this process owns the file while the store is open, unless
    `shared` (several API processes, `--api-server-count`): then each operation takes the
    file's write lock first (`BEGIN IMMEDIATE`) and reads the totals and the newest stamp back,
    as the other processes left them.

    The row count and byte total live in Python, read back from the `totals` row (which the
    file's triggers keep) on opening, after a rollback and, when shared, in each operation, so
    the limits hold across restarts and processes without a scan per call. Kinds
    and keys reach SQL only as bound parameters. Opening applies `limits` at once, so a file
    reopened with smaller limits is trimmed before the first call.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        limits: StoreLimits = DEFAULT_LIMITS,
        *,
        clock: Callable[[], float] = time.time,
        shared: bool = False,
    ) -> None:
        super().__init__(limits, clock)
        self.path = Path(path).expanduser()
        self.shared = shared
        self._conn = _connect(self.path)
        self._num_rows, self._total_bytes = 0, 0
        self._load_totals()
        self._load_newest_stamp()
        with self._operation():
            self._evict()

    def _load_newest_stamp(self) -> None:
        newest_s = self._conn.execute("SELECT MAX(touched_at) FROM records").fetchone()[0]
        if newest_s is not None:
            self._last_stamp_s = max(self._last_stamp_s, newest_s)

    def _begin(self) -> None:
        if self.shared:  # (the file's write lock, waited for up to sqlite3's 5 s timeout)
            self._conn.execute("BEGIN IMMEDIATE")
            self._load_totals()
            self._load_newest_stamp()

    def _load_totals(self) -> None:
        count, total = self._conn.execute("SELECT num_rows, num_bytes FROM totals").fetchone()
        self._num_rows, self._total_bytes = count, int(total)

    def _size(self, kind: str, key: str) -> int | None:
        row = self._conn.execute(
            "SELECT size FROM records WHERE kind = ? AND key = ?", (kind, key)
        ).fetchone()
        return None if row is None else row[0]

    def _read(self, kind: str, key: str) -> str | None:
        row = self._conn.execute(
            "SELECT body FROM records WHERE kind = ? AND key = ?", (kind, key)
        ).fetchone()
        return None if row is None else row[0]

    def _write(self, kind: str, key: str, body: str, size: int, touched_at_s: float) -> None:
        old_size = self._size(kind, key)
        self._conn.execute(
            "INSERT INTO records (kind, key, body, size, touched_at) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (kind, key) DO UPDATE SET "
            "body = excluded.body, size = excluded.size, touched_at = excluded.touched_at",
            (kind, key, body, size, touched_at_s),
        )
        if old_size is None:
            self._num_rows += 1
        else:
            self._total_bytes -= old_size
        self._total_bytes += size

    def _touch(self, kind: str, key: str, touched_at_s: float) -> None:
        self._conn.execute(
            "UPDATE records SET touched_at = ? WHERE kind = ? AND key = ?",
            (touched_at_s, kind, key),
        )

    def _remove(self, kind: str, key: str) -> bool:
        size = self._size(kind, key)
        if size is None:
            return False
        self._conn.execute("DELETE FROM records WHERE kind = ? AND key = ?", (kind, key))
        self._num_rows -= 1
        self._total_bytes -= size
        return True

    def _least_recent(self) -> Stamp | None:
        row = self._conn.execute(
            "SELECT kind, key, touched_at FROM records ORDER BY touched_at LIMIT 1"
        ).fetchone()
        return None if row is None else Stamp(*row)

    def _seq(self, kind: str, key: str) -> int | None:
        row = self._conn.execute(
            "SELECT seq FROM records WHERE kind = ? AND key = ?", (kind, key)
        ).fetchone()
        return None if row is None else row[0]

    def _scan(self, kind: str, after_seq: int | None, *, descending: bool) -> Iterator[str]:
        # Only these fixed fragments are formatted into the SQL; kind and seq are parameters.
        where, params = "kind = ?", [kind]
        if after_seq is not None:
            where += " AND seq < ?" if descending else " AND seq > ?"
            params.append(after_seq)
        direction = "DESC" if descending else "ASC"
        cursor = self._conn.execute(
            f"SELECT body FROM records WHERE {where} ORDER BY seq {direction}", params
        )
        try:
            while rows := cursor.fetchmany(SCAN_BATCH):
                for (body,) in rows:
                    yield body
        finally:
            cursor.close()

    def _num_entries(self) -> int:
        return self._num_rows

    def _num_bytes(self) -> int:
        return self._total_bytes

    def _commit(self) -> None:
        if self._conn.in_transaction:
            self._conn.commit()

    def _rollback(self) -> None:
        self._conn.rollback()
        self._load_totals()

    def _close(self) -> None:
        self._conn.close()


def _connect(path: Path) -> sqlite3.Connection:
    """An open connection to a store file at `path`, in WAL mode, with the schema in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # The store's own lock serialises every use, so any thread may hold the connection.
        conn = sqlite3.connect(path, check_same_thread=False)
    except sqlite3.Error as e:
        raise ValueError(f"cannot open the record store {path}: {e}") from None
    try:
        _prepare(conn, path)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise ValueError(
            f"{path} is not a SQLite database ({e}): point the record store at a new file, "
            "or move this one away"
        ) from None
    except BaseException:
        conn.close()
        raise
    return conn


def _prepare(conn: sqlite3.Connection, path: Path) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]  # a non-database fails here
    if version not in (0, 1, SCHEMA_VERSION):
        raise ValueError(
            f"{path} is a SQLite database of schema version {version}, not a record store of "
            f"version {SCHEMA_VERSION}: point the record store at a new file"
        )
    conn.execute("PRAGMA journal_mode=WAL")
    # With WAL, NORMAL cannot corrupt the file; a power cut may lose the last few commits.
    conn.execute("PRAGMA synchronous=NORMAL")
    # One transaction: a process sharing the file cannot write between the totals' first count
    # (a file of version 1 has rows and no triggers) and the triggers that keep them.
    conn.executescript(f"BEGIN IMMEDIATE; {SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
