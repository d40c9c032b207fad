"""The n-gram index against a brute-force search of the whole history, as tokens arrive."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.speculation.ngram import NgramIndex


def brute_force(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """The longest n whose end-of-sequence n-gram occurs ending earlier, at its latest such
    occurrence: the k tokens after it."""
    size = len(tokens)
    for n in range(min(ngram_max, size), ngram_min - 1, -1):
        suffix = tokens[size - n :]
        for end in range(size - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    ngram_min=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 6),
    chunk=st.integers(1, 7),
)
def test_proposals_match_a_search_of_the_whole_history(tokens, ngram_min, extra, k, chunk):
    index = NgramIndex(ngram_min, ngram_min + extra)
    for start in range(0, len(tokens), chunk):  # a prompt, then tokens in bursts
        index.extend(tokens[start : start + chunk])
        seen = tokens[: start + chunk]
        assert index.propose(k) == brute_force(seen, ngram_min, ngram_min + extra, k)


def test_a_copy_is_proposed_from_its_source():
    source = list(range(100, 140))
    index = NgramIndex(2, 4)
    index.extend([*source, 7, 8, *source[:5]])
    assert index.propose(4) == source[5:9]
    assert index.match() == (4, 4)  # 4-gram 101..104 ended at position 4


def test_no_match_no_draft():
    index = NgramIndex(2, 3)
    index.extend([1, 2, 3, 4])
    assert index.propose(4) == []
    index.extend([2])  # a 1-gram repeat is below ngram_min
    assert index.propose(4) == []


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="ngram_min"):
        NgramIndex(3, 2)
