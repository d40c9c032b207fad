"""Routing requests over data-parallel engine cores: a prompt goes where the deepest beginning
of it already went (that core's prefix cache holds it), unless that core is too busy; the rest
go to the least loaded core; the table stays bounded."""

from __future__ import annotations

from metrale.engine.request_router import RequestRouter

BLOCK = 4


def prompt(*blocks: int, extra: int = 0) -> list[int]:
    """Full blocks of the given fill values, then `extra` loose tokens."""
    return [b for b in blocks for _ in range(BLOCK)] + [99] * extra


def test_new_prompts_spread_by_load_and_return_to_their_core():
    router = RequestRouter(3, BLOCK)
    cores = [router.route(prompt(i, 50 + i)) for i in range(3)]
    assert sorted(cores) == [0, 1, 2]  # nothing in common: the least loaded each time
    # a conversation's next turn: its prompt is the last one plus more
    assert router.route(prompt(1, 51, 7, 8, extra=2)) == cores[1]
    assert router.num_affine == 1
    # a prompt shorter than a block has no key: the least loaded (ties: the lowest index)
    router.finished(cores[0])
    assert router.route([1, 2]) == cores[0]


def test_the_deepest_known_beginning_wins():
    router = RequestRouter(2, BLOCK, slack=0)
    assert router.route(prompt(1)) == 0  # (1) -> core 0
    # (1, 2) would follow (1) to core 0, but core 0 is busier: core 1 takes it, and both of its
    # beginnings, (1) and (1, 2), are core 1's from now on
    assert router.route(prompt(1, 2)) == 1
    router.finished(0)
    router.finished(1)
    assert router.route(prompt(1, 9)) == 1
    assert router.route(prompt(7)) == 0
    # deeper than any key: its 2-block beginning (core 1's); load alone would pick core 0
    router.slack = 4
    assert router.route(prompt(1, 2, 3, 4, 5)) == 1
    assert router.num_affine == 2


def test_a_busy_core_is_passed_over_for_the_least_loaded():
    router = RequestRouter(2, BLOCK, slack=2)
    system = prompt(1, 2)
    assert [router.route(system + prompt(10 + i)) for i in range(3)] == [0, 0, 0]
    # core 0 holds 3, core 1 none: 3 > 0 + 2, so the shared system prompt goes to core 1
    assert router.route(system + prompt(20)) == 1
    assert router.load == [3, 1]
    # and that prompt's own continuation follows it there
    assert router.route(system + prompt(20, 21)) == 1


def test_the_table_is_bounded():
    router = RequestRouter(2, BLOCK, max_entries=8)
    for i in range(50):
        router.route(prompt(i, i + 1000))
        router.finished(0 if router.load[0] else 1)
    assert len(router._owners) <= 8
    assert router.load == [0, 0]
