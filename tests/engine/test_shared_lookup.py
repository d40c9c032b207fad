"""The shared n-gram table: what a finished request wrote becomes a later request's draft, within
a tenant only, bounded, least recently used evicted first."""

from __future__ import annotations

import pytest

from metrale.engine.speculation.shared_lookup import SharedLookup, fingerprint

FINGERPRINTS = ("model", "tokenizer")


def table(max_entries: int = 1000) -> SharedLookup:
    return SharedLookup(3, 4, max_entries, FINGERPRINTS)


def test_a_finished_requests_text_drafts_a_later_request():
    shared = table()
    shared.feed("alice", [5, 6, 7, 8, 9, 10, 11, 12])
    assert shared.lookup("alice", [1, 2, 6, 7, 8]) == [9, 10, 11, 12]
    assert shared.lookup("alice", [9, 10, 11]) == [12]
    assert shared.lookup("alice", [7, 8]) == []  # shorter than the n-gram
    assert shared.lookup("alice", [4, 7, 8]) == []


def test_tenants_never_see_each_others_text():
    shared = table()
    shared.feed("alice", [5, 6, 7, 8, 9])
    assert shared.lookup("bob", [5, 6, 7]) == []
    assert shared.lookup(None, [5, 6, 7]) == []
    shared.feed(None, [5, 6, 7, 1])
    assert shared.lookup(None, [5, 6, 7]) == [1]
    assert shared.lookup("alice", [5, 6, 7]) == [8, 9]


def test_the_table_is_bounded_and_evicts_the_least_recently_used():
    shared = table(max_entries=3)
    shared.feed("t", [1, 2, 3, 4, 5])  # (1,2,3) and (2,3,4)
    assert shared.lookup("t", [1, 2, 3]) == [4, 5]  # now the most recent
    shared.feed("t", [7, 8, 9, 10, 11])  # (7,8,9), (8,9,10): one must go
    assert len(shared) == 3
    assert shared.lookup("t", [2, 3, 4]) == []  # the least recently used went
    assert shared.lookup("t", [1, 2, 3]) == [4, 5]
    assert shared.lookup("t", [8, 9, 10]) == [11]


def test_a_later_occurrence_replaces_an_earlier_continuation():
    shared = table()
    shared.feed("t", [1, 2, 3, 4])
    shared.feed("t", [1, 2, 3, 9, 9])
    assert shared.lookup("t", [1, 2, 3]) == [9, 9]


def test_fingerprints_tell_apart_what_they_hash():
    assert fingerprint("a", "bc") != fingerprint("ab", "c")
    assert fingerprint(b"x") == fingerprint("x")
    with pytest.raises(ValueError, match="max_entries"):
        SharedLookup(3, 4, 0, FINGERPRINTS)
