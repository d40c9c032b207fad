"""The engine process's allocator: tcmalloc preloaded where the system has it."""

from __future__ import annotations

import os

import pytest

from metrale.engine import allocator
from metrale.engine.allocator import engine_process_allocator, preloaded_allocator


@pytest.fixture
def found(monkeypatch):
    """The system library lookup (the boundary) answers with a tcmalloc."""
    monkeypatch.setattr(allocator, "tcmalloc_library", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.delenv("LD_PRELOAD", raising=False)


def test_preloads_tcmalloc_for_the_start_only(found):
    with engine_process_allocator(True) as chosen:
        assert chosen == "libtcmalloc_minimal.so.4"
        assert os.environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
        assert preloaded_allocator() == "libtcmalloc_minimal.so.4"
    assert "LD_PRELOAD" not in os.environ
    assert preloaded_allocator() == "glibc"


def test_keeps_other_preloads_and_restores_them(found, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/libiomp5.so")
    with engine_process_allocator(True):
        assert os.environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 /opt/libiomp5.so"
    assert os.environ["LD_PRELOAD"] == "/opt/libiomp5.so"


def test_an_allocator_the_user_preloaded_wins(found, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    with engine_process_allocator(True) as chosen:
        assert chosen == "libjemalloc.so.2"
        assert os.environ["LD_PRELOAD"] == "/usr/lib/libjemalloc.so.2"


def test_off_or_absent_leaves_glibc(found, monkeypatch):
    with engine_process_allocator(False) as chosen:
        assert chosen == "glibc" and "LD_PRELOAD" not in os.environ
    monkeypatch.setattr(allocator, "tcmalloc_library", lambda: None)
    with engine_process_allocator(True) as chosen:
        assert chosen == "glibc" and "LD_PRELOAD" not in os.environ
