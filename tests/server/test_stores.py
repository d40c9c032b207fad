"""The record store's rules, held by both backends alike, and what only SQLite adds.

Every behaviour runs against `memory` and `sqlite` (a file in tmp_path); time comes from a fake
clock the tests advance, so TTLs are tested without sleeping. A property test runs random
put/get/delete/advance sequences against both backends and a small reference model at once.
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.server.stores import Page, RecordStore, StoreLimits, open_store
from metrale.server.stores.memory import MemoryStore
from metrale.server.stores.sqlite import SqliteStore

BACKENDS = ["memory", "sqlite"]


class FakeClock:
    def __init__(self, now_s: float = 1_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


MakeStore = Callable[..., RecordStore]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=BACKENDS)
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> Iterator[MakeStore]:
    """A factory of stores of one backend on the fake clock; each SQLite one a fresh file."""
    stores: list[RecordStore] = []

    def make(limits: StoreLimits = StoreLimits(ttl_s=None)) -> RecordStore:  # noqa: B008
        if request.param == "memory":
            store: RecordStore = MemoryStore(limits, clock=clock)
        else:
            store = SqliteStore(tmp_path / f"store{len(stores)}.db", limits, clock=clock)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def size_of(record: dict[str, Any]) -> int:
    return len(json.dumps(record, ensure_ascii=False).encode())


def keys(page: Page) -> list[str]:
    return [record["id"] for record in page.records]


def put_ids(store: RecordStore, kind: str, ids: list[str]) -> None:
    for key in ids:
        store.put(kind, key, {"id": key})


# Both backends.


def test_put_get_replace_delete(make_store: MakeStore) -> None:
    store = make_store()
    assert store.get("response", "r1") is None
    store.put("response", "r1", {"id": "r1", "text": "héllo ✓", "n": [1, 2.5, None, True]})
    assert store.get("response", "r1") == {"id": "r1", "text": "héllo ✓", "n": [1, 2.5, None, True]}
    # The same key under another kind is another record.
    store.put("conversation", "r1", {"id": "c"})
    assert store.get("response", "r1")["id"] == "r1"  # type: ignore[index]
    assert len(store) == 2

    store.put("response", "r1", {"id": "r1", "text": "replaced"})
    assert store.get("response", "r1") == {"id": "r1", "text": "replaced"}
    assert len(store) == 2

    assert store.delete("response", "r1") is True
    assert store.delete("response", "r1") is False
    assert store.get("response", "r1") is None
    assert store.get("conversation", "r1") == {"id": "c"}
    assert len(store) == 1


def test_records_are_copies(make_store: MakeStore) -> None:
    store = make_store()
    given_record = {"id": "a", "items": [{"x": 1}]}
    store.put("k", "a", given_record)
    given_record["items"][0]["x"] = 99
    given_record["extra"] = True

    got = store.get("k", "a")
    assert got == {"id": "a", "items": [{"x": 1}]}
    got["items"].append("mutated")  # type: ignore[index]
    store.list("k").records[0]["items"].append("mutated too")
    assert store.get("k", "a") == {"id": "a", "items": [{"x": 1}]}


def test_refuses_what_is_not_a_json_object(make_store: MakeStore) -> None:
    store = make_store()
    with pytest.raises(TypeError):
        store.put("k", "a", ["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.put("k", "a", {"when": object()})
    with pytest.raises(TypeError):
        store.put("k", 7, {"id": 7})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="surrogate"):
        store.put("k", "a", {"text": "\ud800"})
    with pytest.raises(ValueError, match="surrogate"):
        store.get("k", "\udfff")
    assert len(store) == 0


def test_list_in_creation_order(make_store: MakeStore) -> None:
    store = make_store()
    put_ids(store, "resp", ["a", "b", "c", "d", "e"])
    put_ids(store, "other", ["x"])
    store.get("resp", "a")  # recency does not change creation order
    store.put("resp", "b", {"id": "b", "v": 2})  # nor does replacing

    assert keys(store.list("resp")) == ["e", "d", "c", "b", "a"]
    assert keys(store.list("resp", order="asc")) == ["a", "b", "c", "d", "e"]
    assert store.list("resp", order="asc").records[1] == {"id": "b", "v": 2}

    first = store.list("resp", limit=2, order="asc")
    assert (keys(first), first.has_more) == (["a", "b"], True)
    second = store.list("resp", limit=2, order="asc", after="b")
    assert (keys(second), second.has_more) == (["c", "d"], True)
    last = store.list("resp", limit=2, order="asc", after="d")
    assert (keys(last), last.has_more) == (["e"], False)
    exact = store.list("resp", limit=5)
    assert (len(exact.records), exact.has_more) == (5, False)

    assert keys(store.list("resp", after="c")) == ["b", "a"]  # desc: past c means older
    assert keys(store.list("resp", after="a")) == []
    assert store.list("resp", after="a").has_more is False
    assert keys(store.list("nothing")) == []
    assert store.list("resp", limit=0) == Page([], True)


def test_list_match_filters_before_the_limit(make_store: MakeStore) -> None:
    store = make_store()
    for i in range(8):
        store.put("resp", f"r{i}", {"id": f"r{i}", "conv": "even" if i % 2 == 0 else "odd"})

    def even(record: dict[str, Any]) -> bool:
        return record["conv"] == "even"

    page = store.list("resp", order="asc", limit=2, match=even)
    assert (keys(page), page.has_more) == (["r0", "r2"], True)
    page = store.list("resp", order="asc", limit=2, match=even, after="r2")
    # r7 follows r6 but does not match, so nothing more does.
    assert (keys(page), page.has_more) == (["r4", "r6"], False)
    # `after` need not match itself.
    assert keys(store.list("resp", order="asc", limit=1, match=even, after="r3")) == ["r4"]


def test_list_after_an_unknown_key_is_a_key_error(make_store: MakeStore) -> None:
    store = make_store()
    put_ids(store, "resp", ["a"])
    put_ids(store, "other", ["b"])
    with pytest.raises(KeyError):
        store.list("resp", after="missing")
    with pytest.raises(KeyError):
        store.list("resp", after="b")  # a key of another kind
    store.delete("resp", "a")
    with pytest.raises(KeyError):
        store.list("resp", after="a")
    with pytest.raises(ValueError):
        store.list("resp", limit=-1)
    with pytest.raises(ValueError):
        store.list("resp", order="up")  # type: ignore[arg-type]


def test_evicts_least_recently_used_by_entries(make_store: MakeStore) -> None:
    store = make_store(StoreLimits(max_entries=3, ttl_s=None))
    store.put("resp", "a", {"id": "a"})
    store.put("conv", "b", {"id": "b"})
    store.put("resp", "c", {"id": "c"})
    assert store.get("resp", "a") is not None  # a is now the most recent; b the least
    store.list("conv")  # listing is not use: b stays the least recent
    store.put("resp", "d", {"id": "d"})
    assert len(store) == 3
    assert store.get("conv", "b") is None  # evicted across kinds
    store.put("resp", "c", {"id": "c", "v": 2})  # a replace is a use too: a is now least
    store.put("conv", "e", {"id": "e"})
    assert store.get("resp", "a") is None
    assert keys(store.list("resp", order="asc")) == ["c", "d"]
    assert keys(store.list("conv")) == ["e"]


def test_evicts_least_recently_used_by_bytes(make_store: MakeStore) -> None:
    record = {"id": "a", "pad": "x" * 50}
    size = size_of(record)
    store = make_store(StoreLimits(max_bytes=3 * size, ttl_s=None))
    for key in "abc":
        store.put("resp", key, {"id": key, "pad": "x" * 50})
    assert len(store) == 3
    store.get("resp", "a")
    store.put("resp", "d", {"id": "d", "pad": "x" * 50})
    assert keys(store.list("resp", order="asc")) == ["a", "c", "d"]

    # A record nearly twice as large pushes out the two least recent ones.
    store.get("resp", "c")  # used a, d, c
    store.put("resp", "big", {"id": "big", "pad": "x" * (size + 40)})
    assert keys(store.list("resp", order="asc")) == ["c", "big"]

    # Replacing a record with a smaller one frees its bytes: two small ones fit again.
    store.put("resp", "big", {"id": "big"})
    store.put("resp", "e", {"id": "e", "pad": "x" * 50})
    assert keys(store.list("resp", order="asc")) == ["c", "big", "e"]


def test_a_record_larger_than_the_store_is_refused(make_store: MakeStore) -> None:
    fits = {"id": "a", "pad": "é" * 20}  # 2 bytes each in utf-8
    store = make_store(StoreLimits(max_bytes=size_of(fits), ttl_s=None))
    store.put("resp", "a", fits)  # exactly max_bytes fits
    with pytest.raises(ValueError, match="bytes"):
        store.put("resp", "a", {"id": "a", "pad": "é" * 20 + "x"})  # one byte over
    # Nothing was stored or evicted: the old record is still there.
    assert store.get("resp", "a") == fits
    assert len(store) == 1


def test_ttl_counts_from_the_last_touch(make_store: MakeStore, clock: FakeClock) -> None:
    store = make_store(StoreLimits(ttl_s=10.0))
    put_ids(store, "resp", ["read", "listed", "written"])
    clock.advance(6)
    store.get("resp", "read")
    store.list("resp")  # not a touch
    store.put("resp", "written", {"id": "written", "v": 2})
    clock.advance(4.1)  # 10.1 s since the put of all three
    assert store.get("resp", "listed") is None
    assert keys(store.list("resp", order="asc")) == ["read", "written"]
    assert len(store) == 2
    clock.advance(5.8)  # 9.9 s since the last touch of the other two
    assert len(store) == 2
    clock.advance(0.2)
    assert len(store) == 0
    assert store.delete("resp", "read") is False
    assert keys(store.list("resp")) == []


def test_expired_records_do_not_count_against_the_limits(
    make_store: MakeStore, clock: FakeClock
) -> None:
    store = make_store(StoreLimits(max_entries=2, ttl_s=10.0))
    put_ids(store, "resp", ["old"])
    clock.advance(5)
    put_ids(store, "resp", ["young"])
    clock.advance(6)  # old is gone; young has 4 s left
    put_ids(store, "resp", ["new"])  # fits without evicting young
    assert keys(store.list("resp", order="asc")) == ["young", "new"]
    with pytest.raises(KeyError):
        store.list("resp", after="old")


def test_len_counts_all_kinds(make_store: MakeStore) -> None:
    store = make_store()
    assert len(store) == 0
    put_ids(store, "a", ["1", "2"])
    put_ids(store, "b", ["1"])
    store.put("a", "1", {"id": "1", "again": True})
    assert len(store) == 3
    store.delete("b", "1")
    assert len(store) == 2


def test_threads_share_a_store(make_store: MakeStore) -> None:
    store = make_store(StoreLimits(max_entries=50, ttl_s=None))

    def work(n: int) -> None:
        for i in range(40):
            store.put("resp", f"{n}-{i}", {"id": f"{n}-{i}"})
            store.get("resp", f"{n}-{i // 2}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store) == 50
    assert len(store.list("resp", limit=100).records) == 50


def test_a_closed_store_refuses_calls(make_store: MakeStore) -> None:
    store = make_store()
    store.close()
    store.close()  # closing twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        store.get("resp", "a")


# Opening by spec, and the limits' own checks.


def test_open_store_by_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    memory = open_store("memory", StoreLimits(max_entries=7))
    assert isinstance(memory, MemoryStore) and memory.limits.max_entries == 7
    monkeypatch.setenv("HOME", str(tmp_path))
    sqlite = open_store("sqlite:~/nested/dir/store.db")
    assert isinstance(sqlite, SqliteStore)
    assert sqlite.path == tmp_path / "nested" / "dir" / "store.db"
    sqlite.put("resp", "a", {"id": "a"})
    sqlite.close()
    assert (tmp_path / "nested" / "dir" / "store.db").is_file()
    for spec in ["redis://x", "sqlite:", "Memory", ""]:
        with pytest.raises(ValueError, match=r"'memory'.*'sqlite:PATH'"):
            open_store(spec)


@pytest.mark.parametrize(
    "fields", [{"max_entries": 0}, {"max_bytes": 0}, {"ttl_s": 0}, {"ttl_s": -1.0}]
)
def test_limits_are_checked(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        StoreLimits(**fields)


# SQLite only.


def test_sqlite_reopen_keeps_records_order_and_accounting(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "store.db"
    size = size_of({"id": "a", "pad": "x" * 30})
    by_entries = StoreLimits(max_entries=3, ttl_s=None)
    by_bytes = StoreLimits(max_bytes=3 * size, ttl_s=None)
    for limits in (by_entries, by_bytes):
        path.unlink(missing_ok=True)
        store = SqliteStore(path, limits, clock=clock)
        for key in "cab":  # created c, a, b
            store.put("resp", key, {"id": key, "pad": "x" * 30})
        store.get("resp", "c")  # used a, b, c: a is the least recent
        store.close()

        store = SqliteStore(path, limits, clock=clock)
        assert len(store) == 3
        assert keys(store.list("resp", order="asc")) == ["c", "a", "b"]
        store.put("resp", "d", {"id": "d", "pad": "x" * 30})
        assert keys(store.list("resp", order="asc")) == ["c", "b", "d"]
        store.put("resp", "e", {"id": "e", "pad": "x" * 30})  # next least recent: b
        assert keys(store.list("resp", order="asc")) == ["c", "d", "e"]
        store.close()


def test_sqlite_reopen_with_smaller_limits_trims_at_once(tmp_path: Path) -> None:
    clock = FakeClock()
    store = SqliteStore(tmp_path / "s.db", StoreLimits(ttl_s=None), clock=clock)
    put_ids(store, "resp", ["a", "b", "c", "d"])
    store.close()
    store = SqliteStore(tmp_path / "s.db", StoreLimits(max_entries=2, ttl_s=None), clock=clock)
    assert keys(store.list("resp", order="asc")) == ["c", "d"]
    store.close()


def test_sqlite_stamps_keep_increasing_after_reopen(tmp_path: Path) -> None:
    # A clock behind the stored stamps (a fake one restarted, or a wall clock set back) must not
    # make the records touched after reopening look older than those touched before it.
    store = SqliteStore(
        tmp_path / "s.db", StoreLimits(max_entries=2, ttl_s=None), clock=FakeClock(500)
    )
    put_ids(store, "resp", ["a", "b"])
    store.close()
    store = SqliteStore(
        tmp_path / "s.db", StoreLimits(max_entries=2, ttl_s=None), clock=FakeClock(0)
    )
    store.get("resp", "a")
    put_ids(store, "resp", ["c"])
    assert keys(store.list("resp", order="asc")) == ["a", "c"]
    store.close()


def test_sqlite_uses_wal(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    store.put("resp", "a", {"id": "a"})
    conn = sqlite3.connect(tmp_path / "s.db")
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()
        store.close()


def test_sqlite_takes_a_file_of_the_first_schema_and_counts_its_records(tmp_path: Path) -> None:
    """A file written before the `totals` row existed: opening counts its records once, and the
    count is kept from then on (a shared store reads it back, not a scan, in every call)."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE records (seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, key TEXT NOT NULL,"
        " body TEXT NOT NULL, size INTEGER NOT NULL, touched_at REAL NOT NULL, UNIQUE (kind, key));"
        "PRAGMA user_version = 1;"
    )
    now = time.time()
    for i in range(3):
        body = json.dumps({"i": i})
        conn.execute(
            "INSERT INTO records (kind, key, body, size, touched_at) VALUES (?, ?, ?, ?, ?)",
            ("response", f"r{i}", body, len(body), now + i),
        )
    conn.commit()
    conn.close()
    limits = StoreLimits(max_entries=4, max_bytes=10_000, ttl_s=3600)
    store = SqliteStore(path, limits, shared=True)
    try:
        assert len(store) == 3 and store.get("response", "r1") == {"i": 1}
        store.put("response", "r3", {"i": 3})
        store.put("response", "r4", {"i": 4})  # over 4 entries: the least recent, r0, goes
        assert len(store) == 4 and store.get("response", "r0") is None
    finally:
        store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    scanned = conn.execute("SELECT COUNT(*), TOTAL(size) FROM records").fetchone()
    assert conn.execute("SELECT num_rows, num_bytes FROM totals").fetchone() == (4, scanned[1])
    conn.close()


def test_sqlite_refuses_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("these are not the records you are looking for\n" * 200)
    with pytest.raises(ValueError, match=r"notes\.txt.*not a SQLite database"):
        SqliteStore(path)
    assert path.read_text().startswith("these are not")  # and it was left as it was

    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("PRAGMA user_version = 42")
    conn.close()
    with pytest.raises(ValueError, match=r"other\.db.*version 42"):
        SqliteStore(other)


HOSTILE = [
    "'; DROP TABLE records; --",
    '" OR 1=1 --',
    "' OR '1'='1",
    "%",
    "_",
    "\\",
    "",
    " ",
    "line\nbreak\ttab",
    "nul\x00inside",
    "héllo wörld ✓ 日本語 😀",
    "k" * 100_000,
]


def test_sqlite_hostile_keys_and_kinds_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SqliteStore(path, StoreLimits(ttl_s=None))
    for i, name in enumerate(HOSTILE):
        store.put("resp", name, {"i": i, "key": name})
        store.put(name, "k", {"i": i, "kind": name})
    store.close()

    store = SqliteStore(path, StoreLimits(ttl_s=None))
    assert len(store) == 2 * len(HOSTILE)
    for i, name in enumerate(HOSTILE):
        assert store.get("resp", name) == {"i": i, "key": name}
        assert store.list(name).records == [{"i": i, "kind": name}]
    page = store.list("resp", order="asc", limit=100)
    assert [record["key"] for record in page.records] == HOSTILE
    assert [r["i"] for r in store.list("resp", order="asc", after=HOSTILE[0]).records][:1] == [1]
    # Wildcards match only themselves.
    assert store.delete("resp", "%") is True
    assert store.get("resp", "_") is not None
    assert store.delete("resp", HOSTILE[0]) is True
    assert len(store) == 2 * len(HOSTILE) - 2
    store.close()


# Both backends against a reference model.

MODEL_LIMITS = StoreLimits(max_entries=4, max_bytes=200, ttl_s=10.5)  # steps are whole seconds

KINDS = st.sampled_from(["resp", "conv"])
KEYS = st.sampled_from(["k0", "k1", "k2", "k3", "k4", "k5"])
TEXT = st.text(alphabet=st.sampled_from("ab é✓😀"), max_size=90)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), KINDS, KEYS, TEXT),
        st.tuples(st.just("get"), KINDS, KEYS),
        st.tuples(st.just("delete"), KINDS, KEYS),
        st.tuples(st.just("advance"), st.integers(0, 6)),
    ),
    max_size=40,
)


class ModelStore:
    """The rules, written as plainly as possible: a dict in order of use, a creation counter."""

    def __init__(self, limits: StoreLimits, clock: FakeClock) -> None:
        self.limits, self.clock = limits, clock
        # (kind, key) -> (record, size, seq, touched_at), least recently used first
        self.rows: OrderedDict[tuple[str, str], tuple[dict[str, Any], int, int, float]] = (
            OrderedDict()
        )
        self.next_seq = 0

    def expire(self) -> None:
        assert self.limits.ttl_s is not None
        now = self.clock()
        for name, (_, _, _, touched) in list(self.rows.items()):
            if now - touched >= self.limits.ttl_s:
                del self.rows[name]

    def put(self, kind: str, key: str, record: dict[str, Any]) -> None:
        size = size_of(record)
        if size > self.limits.max_bytes:
            raise ValueError
        self.expire()
        old = self.rows.pop((kind, key), None)
        seq = old[2] if old else self.next_seq
        self.next_seq += old is None
        self.rows[kind, key] = (record, size, seq, self.clock())
        while (
            len(self.rows) > self.limits.max_entries
            or sum(row[1] for row in self.rows.values()) > self.limits.max_bytes
        ):
            self.rows.popitem(last=False)

    def get(self, kind: str, key: str) -> dict[str, Any] | None:
        self.expire()
        row = self.rows.pop((kind, key), None)
        if row is None:
            return None
        self.rows[kind, key] = (row[0], row[1], row[2], self.clock())
        return row[0]

    def delete(self, kind: str, key: str) -> bool:
        self.expire()
        return self.rows.pop((kind, key), None) is not None

    def listing(self, kind: str) -> list[dict[str, Any]]:
        self.expire()
        rows = [(seq, record) for (k, _), (record, _, seq, _) in self.rows.items() if k == kind]
        return [record for _, record in sorted(rows, key=lambda row: row[0])]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_backends_agree_with_a_reference_model(ops: list[tuple[Any, ...]]) -> None:
    clock = FakeClock()
    model = ModelStore(MODEL_LIMITS, clock)
    with tempfile.TemporaryDirectory() as tmp:
        stores = [
            MemoryStore(MODEL_LIMITS, clock=clock),
            SqliteStore(Path(tmp) / "s.db", MODEL_LIMITS, clock=clock),
        ]
        try:
            for op, *args in ops:
                if op == "advance":
                    clock.advance(args[0])
                    continue
                if op == "put":
                    kind, key, text = args
                    args = [kind, key, {"key": key, "text": text}]
                outcomes = []
                for target in [model, *stores]:
                    try:
                        outcomes.append(getattr(target, op)(*args))
                    except ValueError:
                        outcomes.append("refused")
                assert outcomes[1:] == outcomes[:1] * len(stores), (op, args)
                for store in stores:
                    assert len(store) == len(model.rows)
                    for kind in ["resp", "conv"]:
                        listed = store.list(kind, order="asc", limit=100)
                        assert listed.records == model.listing(kind), (op, args, kind)
        finally:
            for store in stores:
                store.close()


def test_processes_that_share_a_sqlite_store_keep_its_limits_together(tmp_path: Path) -> None:
    """Several API processes (`--api-server-count`) open one file: each call reads what the
    others wrote, so recency, eviction and the limits are the file's, not one process's."""
    path = tmp_path / "shared.db"
    limits = StoreLimits(max_entries=2, max_bytes=10_000, ttl_s=3600)
    one = SqliteStore(path, limits, shared=True)
    two = SqliteStore(path, limits, shared=True)
    try:
        one.put("response", "a", {"n": 1})
        two.put("response", "b", {"n": 2})
        assert one.get("response", "a") == {"n": 1}  # "a" is now more recent than "b"
        two.put("response", "c", {"n": 3})  # over the limit: the least recent, "b", goes
        assert len(one) == len(two) == 2
        assert two.get("response", "b") is None
        assert one.get("response", "a") == {"n": 1} and one.get("response", "c") == {"n": 3}
    finally:
        one.close()
        two.close()


def _put_many(path: str, prefix: str, count: int) -> None:
    store = SqliteStore(path, StoreLimits(max_entries=30, max_bytes=10**6, ttl_s=3600), shared=True)
    try:
        for i in range(count):
            store.put("response", f"{prefix}{i}", {"i": i, "pad": "x" * 100})
    finally:
        store.close()


def test_concurrent_writers_in_processes_never_pass_the_limits(tmp_path: Path) -> None:
    import multiprocessing

    path = str(tmp_path / "shared.db")
    SqliteStore(path).close()  # the schema in place before the writers race
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_put_many, args=(path, p, 80)) for p in "xyz"]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
    assert [w.exitcode for w in writers] == [0, 0, 0]
    rows = sqlite3.connect(path).execute("SELECT COUNT(*) FROM records").fetchone()[0]
    assert rows == 30  # and not one process's view of it
    # The totals row the file's triggers keep agrees with a scan, after 240 racing writes.
    conn = sqlite3.connect(path)
    scanned = conn.execute("SELECT COUNT(*), TOTAL(size) FROM records").fetchone()
    assert conn.execute("SELECT num_rows, num_bytes FROM totals").fetchone() == (30, scanned[1])
    keys = [k for (k,) in sqlite3.connect(path).execute("SELECT key FROM records")]
    for prefix in "xyz":  # eviction by the file's recency: what is left of a writer is its last
        kept = sorted(int(key[1:]) for key in keys if key[0] == prefix)
        assert kept == list(range(80 - len(kept), 80))
