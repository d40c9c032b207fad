"""Stored responses, conversations and chat completions: one bounded record store, two backends.

`open_store("memory")` keeps records in this process; `open_store("sqlite:PATH")` keeps them in
a file that survives restarts. Both evict the least recently used records past `StoreLimits`.
"""

from __future__ import annotations

from pathlib import Path

from metrale.server.stores.base import DEFAULT_LIMITS, Page, RecordStore, StoreLimits
from metrale.server.stores.memory import MemoryStore
from metrale.server.stores.sqlite import SqliteStore

__all__ = ["Page", "RecordStore", "StoreLimits", "open_store"]

SQLITE_PREFIX = "sqlite:"


def open_store(
    spec: str, limits: StoreLimits = DEFAULT_LIMITS, *, shared: bool = False
) -> RecordStore:
    """The store `spec` names: "memory", or "sqlite:PATH" (PATH may start with ~). `shared`:
    other processes use the same file at the same time (only a SQLite store can be)."""
    if spec == "memory":
        if shared:
            raise ValueError("a store in memory belongs to one process; share a sqlite: one")
        return MemoryStore(limits)
    path = spec.removeprefix(SQLITE_PREFIX)
    if spec.startswith(SQLITE_PREFIX) and path:
        return SqliteStore(Path(path).expanduser(), limits, shared=shared)
    raise ValueError(
        f"unknown record store {spec!r}: use 'memory' (kept in this process, lost on restart) "
        "or 'sqlite:PATH' (a SQLite file that survives restarts, e.g. sqlite:~/.metrale/store.db)"
    )
