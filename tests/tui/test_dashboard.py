"""The dashboard: its state model driven by hand-made events, and the real app driven headless
through a real `EventBus` subscription with textual's pilot."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("textual", reason="the dashboard needs textual: pip install textual")

from rich.console import Console, RenderableType
from textual.pilot import Pilot
from textual.widgets import DataTable, ProgressBar, RichLog, Sparkline, Static

from metrale.telemetry import events
from metrale.telemetry.bus import EventBus
from metrale.tui import dashboard, widgets
from metrale.tui.dashboard import Dashboard, run_dashboard
from metrale.tui.state import (
    MAX_LOG_LINES,
    DashboardState,
    PhaseStatus,
    RequestStatus,
    percentile,
)

T0 = 1_767_225_600.0
NAMES = ("resolve model", "load config", "select kernels", "backend", "communication backend")
NAMES += ("preflight and weights", "tokenizer and template", "scheduler", "router", "listening")
SCREENSHOT_SCRIPT = Path(__file__).parents[2] / "scripts" / "tui_screenshot.py"


def text_of(renderable: RenderableType) -> str:
    console = Console(width=120, file=io.StringIO(), color_system=None)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


def phase(index: int, duration_s: float | None = None) -> events.Phase:
    name = NAMES[index - 1]
    return events.Phase(time=T0, index=index, total=10, name=name, duration_s=duration_s)


def startup(num_done: int = 10) -> list[events.Event]:
    out: list[events.Event] = []
    for index in range(1, num_done + 1):
        out += [phase(index), phase(index, 0.5 * index)]
    return out


def admitted(request_id: str, api: str = "chat", prompt_tokens: int = 100, at: float = T0):
    return events.RequestAdmitted(
        time=at, request_id=request_id, api=api, prompt_tokens=prompt_tokens, max_tokens=64
    )


def first_token(request_id: str, cached_tokens: int = 0) -> events.RequestFirstToken:
    return events.RequestFirstToken(
        time=T0, request_id=request_id, cached_tokens=cached_tokens, ttft_s=0.1
    )


def finished(
    request_id: str,
    at: float = T0,
    ttft_s: float | None = 0.1,
    generated_tokens: int = 11,
    decode_s: float | None = 0.5,
    api: str = "chat",
) -> events.RequestFinished:
    return events.RequestFinished(
        time=at,
        request_id=request_id,
        api=api,
        finish_reason="stop",
        prompt_tokens=100,
        cached_tokens=0,
        generated_tokens=generated_tokens,
        queue_s=0.01,
        ttft_s=ttft_s,
        decode_s=decode_s,
        e2e_s=1.0,
    )


def summary(live: dict[str, int] | None = None, **fields: object) -> events.StepSummary:
    figures: dict[str, object] = dict(
        running=2,
        waiting=1,
        kv_cache_usage=0.42,
        prefix_cache_hit_rate=0.25,
        prompt_tokens_per_s=1000.0,
        generation_tokens_per_s=200.0,
        steps=5,
    )
    figures.update(fields)
    entries = [events.LiveRequest(rid, count) for rid, count in (live or {}).items()]
    return events.StepSummary(time=T0, live=entries, **figures)  # type: ignore[arg-type]


def state_of(*sequence: events.Event | object) -> DashboardState:
    state = DashboardState()
    for event in sequence:
        state.apply(event)
    return state


# -- the state model -------------------------------------------------------------------------


def test_phases_progress_from_pending_to_done() -> None:
    state = state_of(*startup(3), phase(4))
    rows = state.phase_rows()
    assert [row.status for row in rows] == (
        [PhaseStatus.DONE] * 3 + [PhaseStatus.RUNNING] + [PhaseStatus.PENDING] * 6
    )
    assert [row.duration_s for row in rows[:4]] == [0.5, 1.0, 1.5, None]
    assert rows[3].name == "backend" and rows[9].name == ""
    assert (state.num_phases_done, state.num_phases, state.serving) == (3, 10, False)
    table = text_of(widgets.phases_renderable(state))
    assert "4/10" in table and "running" in table and "pending" in table and "1.50 s" in table

    for event in (phase(4, 2.0), phase(5), phase(5, 0.25)):
        state.apply(event)
    assert state.num_phases_done == 5 and not state.startup_done
    state = state_of(*startup(10))
    assert state.startup_done and state.serving
    assert state.startup_s == pytest.approx(27.5)
    line = text_of(widgets.phases_renderable(state))
    assert "10/10 phases done in 27.50 s" in line and "slowest: listening 5.00 s" in line


def test_kv_usage_is_clamped_to_a_fraction() -> None:
    assert state_of(summary(kv_cache_usage=7.0)).kv_cache_usage == 1.0
    assert state_of(summary(kv_cache_usage=-0.5)).kv_cache_usage == 0.0
    assert state_of(summary(kv_cache_usage=float("nan"))).kv_cache_usage is None
    assert widgets.bar_text(0.5, width=10).plain == "█████░░░░░"


def test_a_replayed_phase_start_does_not_reopen_it() -> None:
    state = state_of(phase(1), phase(1, 0.25), phase(1))
    assert state.phases[1].status is PhaseStatus.DONE and state.phases[1].duration_s == 0.25


def test_nearest_rank_percentiles() -> None:
    assert percentile([float(v) for v in range(100, 0, -1)], 50) == 50.0
    assert percentile([float(v) for v in range(1, 101)], 99) == 99.0
    assert percentile([0.3, 0.1, 0.2, 0.4], 50) == 0.2
    assert percentile([0.3, 0.1, 0.2, 0.4], 99) == 0.4
    assert percentile([7.0], 50) == percentile([7.0], 99) == 7.0


def test_ttft_and_itl_over_the_last_minute() -> None:
    state = state_of(
        finished("old", at=T0 - 61.0, ttft_s=9.0, decode_s=9.0),  # out of the window
        finished("a", at=T0 - 30.0, ttft_s=0.4, generated_tokens=11, decode_s=1.0),  # itl 0.1
        finished("b", at=T0 - 20.0, ttft_s=0.1, generated_tokens=5, decode_s=0.8),  # itl 0.2
        finished("c", at=T0 - 10.0, ttft_s=0.3, generated_tokens=1, decode_s=0.0),  # no itl
        finished("d", at=T0 - 5.0, ttft_s=None, generated_tokens=0, decode_s=None),  # none
        finished("e", at=T0, ttft_s=0.2, generated_tokens=3, decode_s=0.1),  # itl 0.05
    )
    ttft, itl = state.ttft(T0), state.itl(T0)
    assert (ttft.p50_s, ttft.p99_s, ttft.num_samples) == (0.2, 0.4, 4)
    assert itl.num_samples == 3
    assert itl.p50_s == pytest.approx(0.1) and itl.p99_s == pytest.approx(0.2)
    later = state.itl(T0 + 45.0)  # "a" and "b" have left the window
    assert (later.p50_s, later.p99_s, later.num_samples) == (0.05, 0.05, 1)
    assert state.ttft(T0 + 120.0).p50_s is None
    table = text_of(widgets.latency_table(state, T0)).splitlines()
    assert [line.split() for line in table[1:3]] == [
        ["TTFT", "200.0", "ms", "400.0", "ms", "4"],
        ["ITL", "100.0", "ms", "200.0", "ms", "3"],
    ]


def test_live_table_follows_requests_until_they_finish() -> None:
    state = state_of(
        admitted("r1", "chat", 120, at=T0), admitted("r2", "messages", 30, at=T0 + 1.0)
    )
    assert [(r.request_id, r.api, r.status) for r in state.live_rows()] == [
        ("r1", "chat", RequestStatus.WAITING),
        ("r2", "messages", RequestStatus.WAITING),
    ]
    state.apply(first_token("r1", cached_tokens=64))
    state.apply(summary({"r1": 7, "r2": 0}))
    r1, r2 = state.live_rows()
    assert (r1.status, r1.prompt_tokens, r1.cached_tokens, r1.generated_tokens) == (
        RequestStatus.DECODING,
        120,
        64,
        7,
    )
    assert (r2.status, r2.cached_tokens, r2.generated_tokens) == (RequestStatus.WAITING, None, 0)
    cells = [[str(cell) for cell in widgets.live_cells(row, T0 + 2.5)] for row in (r1, r2)]
    assert cells == [
        ["r1", "chat", "decoding", "120", "64", "7", "2.5 s"],
        ["r2", "messages", "waiting", "30", "—", "0", "1.5 s"],
    ]
    assert [r.request_id for r in state.live_rows("messages")] == ["r2"]
    assert state.apis == {"chat", "messages"}

    state.apply(finished("r1"))
    assert [r.request_id for r in state.live_rows()] == ["r2"]
    assert state.num_finished == 1


def test_a_summary_alone_does_not_touch_the_table_but_one_after_a_gap_resets_it() -> None:
    state = state_of(admitted("r1"), admitted("r2"), summary({}))
    assert [r.request_id for r in state.live_rows()] == ["r1", "r2"]
    state.apply(events.Dropped(time=T0, count=5))
    assert state.num_dropped == 5
    assert "lost 5 events (5 in all)" in state.logs[-1].message
    status = widgets.status_text(state, "metrale", paused_events=None, stream_ended=False)
    assert "5 dropped" in status.plain
    state.apply(summary({"r2": 3, "r9": 4}))  # r1's finish was lost; r9's admission was
    rows = {r.request_id: r for r in state.live_rows()}
    assert set(rows) == {"r2", "r9"}
    assert (rows["r9"].api, rows["r9"].status, rows["r9"].prompt_tokens) == (
        "?",
        RequestStatus.DECODING,
        None,
    )
    state.apply(summary({}))  # the gap is closed: summaries only update counts again
    assert set(r.request_id for r in state.live_rows()) == {"r2", "r9"}


def test_preemptions_and_logs_become_log_lines() -> None:
    state = state_of(
        events.Log(time=T0, level="warning", logger="metrale.engine", message="[bold]hot"),
        events.Preemption(time=T0, request_id="r7"),
    )
    assert state.num_preemptions == 1
    assert [(line.level, line.logger) for line in state.logs] == [
        ("warning", "metrale.engine"),
        ("warning", "metrale.engine"),
    ]
    assert "[bold]hot" in widgets.log_text(state.logs[0]).plain  # shown as written
    assert "preempted r7" in state.logs[1].message
    assert state.logs_since(1) == [state.logs[1]] and state.logs_since(2) == []
    for number in range(MAX_LOG_LINES + 10):
        state.add_log("info", "x", str(number))
    kept = state.logs_since(0)
    assert len(kept) == MAX_LOG_LINES and kept[-1].message == str(MAX_LOG_LINES + 9)


def test_no_event_content_makes_it_raise() -> None:
    class Stranger(events.Event, frozen=True, tag="stranger"):
        pass

    odd: list[object] = [
        object(),
        None,
        Stranger(),
        events.Phase(index=None, total=None, name=None),  # type: ignore[arg-type]
        events.Phase(index=0, total=10, name="zero"),
        events.Phase(index=2, total=3, name=None, duration_s="slow"),  # type: ignore[arg-type]
        events.RequestAdmitted(request_id=None, api=None, prompt_tokens=None, max_tokens=None),  # type: ignore[arg-type]
        events.RequestFirstToken(request_id=None, cached_tokens=None, ttft_s=None),  # type: ignore[arg-type]
        finished("z", generated_tokens=0, decode_s=0.0, ttft_s=None),
        finished("y", generated_tokens=1, decode_s=0.0),
        events.RequestFinished(
            time=None,  # type: ignore[arg-type]
            request_id=None,  # type: ignore[arg-type]
            api=None,  # type: ignore[arg-type]
            finish_reason=None,  # type: ignore[arg-type]
            prompt_tokens=None,  # type: ignore[arg-type]
            cached_tokens=None,  # type: ignore[arg-type]
            generated_tokens=None,  # type: ignore[arg-type]
            queue_s=None,
            ttft_s=float("nan"),
            decode_s=float("inf"),
            e2e_s=None,  # type: ignore[arg-type]
        ),
        events.Preemption(request_id=None),  # type: ignore[arg-type]
        summary(
            running=None,
            waiting="3",
            kv_cache_usage=float("nan"),
            prefix_cache_hit_rate=None,
            prompt_tokens_per_s=None,
            generation_tokens_per_s=-5.0,
            steps=None,
        ),
        events.StepSummary(
            running=0,
            waiting=0,
            kv_cache_usage=7.0,
            prefix_cache_hit_rate=0.0,
            prompt_tokens_per_s=0.0,
            generation_tokens_per_s=0.0,
            steps=0,
            live=None,  # type: ignore[arg-type]
        ),
        events.StepSummary(
            running=0,
            waiting=0,
            kv_cache_usage=0.0,
            prefix_cache_hit_rate=0.0,
            prompt_tokens_per_s=0.0,
            generation_tokens_per_s=0.0,
            steps=0,
            live=["not a LiveRequest"],  # type: ignore[list-item]
        ),
        events.Log(level=None, logger=None, message=None),  # type: ignore[arg-type]
        events.Dropped(count=None),  # type: ignore[arg-type]
        events.Dropped(time=1e30, count=-4),
    ]
    state = state_of(*odd)
    assert state.num_events == len(odd)
    assert state.num_ignored >= 3  # object(), None and Stranger at least
    assert state.generation_tokens_per_s[0] == 0.0
    assert state.ttft(T0).num_samples == 1 and state.itl(T0).num_samples == 0
    for renderable in (
        widgets.status_text(state, "t", paused_events=3, stream_ended=True),
        widgets.phases_renderable(state),
        widgets.load_text(state),
        widgets.rate_text("prompt", state.prompt_tokens_per_s),
        widgets.rate_text("generation", []),
        widgets.latency_table(state, T0),
        *(widgets.log_text(line) for line in state.logs),
    ):
        text_of(renderable)
    for row in state.live_rows():
        widgets.live_cells(row, T0)


# -- the app, headless -----------------------------------------------------------------------


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def redraw(pilot: Pilot, app: Dashboard, num_events: int) -> None:
    """Let the worker read `num_events` in all, then redraw as the timer would."""
    await until(lambda: app.state.num_events >= num_events)
    app.refresh_view()
    await pilot.pause()


def static_text(app: Dashboard, selector: str) -> str:
    return text_of(app.query_one(selector, Static).content)  # type: ignore[arg-type]


def table_rows(app: Dashboard) -> list[list[str]]:
    table = app.query_one("#live", DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def test_app_shows_startup_then_the_serving_view() -> None:
    async def scenario() -> None:
        bus = EventBus()
        bus.bind_loop()
        for event in startup(3):  # before the dashboard subscribes: replayed to it
            bus.publish(event)
        app = Dashboard(bus.subscribe(), "metrale test", clock=lambda: T0 + 4.0, refresh_s=60)
        async with app.run_test(size=(120, 40)) as pilot:
            bus.publish(phase(4))
            await redraw(pilot, app, 7)
            table = static_text(app, "#phase-table")
            assert "4/10" in table and "backend" in table and "running" in table
            progress = app.query_one("#phase-progress", ProgressBar)
            assert progress.display and (progress.progress, progress.total) == (3, 10)
            assert "starting" in static_text(app, "#status")

            sequence = [
                *startup(10)[7:],
                admitted("r1", "chat", 120, at=T0),
                admitted("r2", "messages", 30, at=T0 + 1.0),
                first_token("r1", 64),
                summary({"r1": 7, "r2": 0}, kv_cache_usage=0.42, prefix_cache_hit_rate=0.25),
                summary({"r1": 9, "r2": 0}, generation_tokens_per_s=300.0),
                finished("r0", at=T0 + 2.0, ttft_s=0.25, generated_tokens=6, decode_s=0.5),
                events.Log(time=T0, level="info", logger="metrale.serve", message="ready"),
                events.Preemption(time=T0, request_id="r2"),
            ]
            for event in sequence:
                bus.publish(event)
            await redraw(pilot, app, 7 + len(sequence))
            assert "10/10 phases done in 27.50 s" in static_text(app, "#phase-table")
            assert not app.query_one("#phase-progress", ProgressBar).display
            assert "serving" in static_text(app, "#status")
            load = static_text(app, "#load")
            assert "running 2" in load and "waiting 1" in load
            assert "42.0%" in load and "█" * 8 + "░" * 12 in load and "25.0%" in load
            assert "preemptions 1" in load
            assert app.query_one("#generation-spark", Sparkline).data == [200.0, 300.0]
            assert "300.0" in static_text(app, "#generation-rate")
            latency = static_text(app, "#latency")
            assert "250.0 ms" in latency and "100.0 ms" in latency  # TTFT; ITL 0.5 / 5
            assert table_rows(app) == [
                ["r1", "chat", "decoding", "120", "64", "9", "4.0 s"],
                ["r2", "messages", "waiting", "30", "—", "0", "3.0 s"],
            ]
            log_lines = [strip.text for strip in app.query_one("#log", RichLog).lines]
            assert any("metrale.serve" in line and "ready" in line for line in log_lines)
            assert any("preempted r2" in line for line in log_lines)

            bus.publish(finished("r1"))
            bus.publish(first_token("r2", 16))
            bus.publish(summary({"r2": 1234}))
            await redraw(pilot, app, 10 + len(sequence))
            assert table_rows(app) == [["r2", "messages", "decoding", "30", "16", "1,234", "3.0 s"]]

    asyncio.run(scenario())


def test_keys_pause_filter_and_quit() -> None:
    async def scenario() -> None:
        bus = EventBus()
        bus.bind_loop()
        app = Dashboard(bus.subscribe(), clock=lambda: T0, refresh_s=60)
        async with app.run_test(size=(120, 40)) as pilot:
            for event in [*startup(), admitted("c1", "chat"), admitted("m1", "messages")]:
                bus.publish(event)
            await redraw(pilot, app, 22)
            assert [row[0] for row in table_rows(app)] == ["c1", "m1"]

            await pilot.press("p")
            assert "PAUSED (0 events since)" in static_text(app, "#status")
            bus.publish(admitted("c2", "chat"))
            bus.publish(events.Log(time=T0, level="info", logger="x", message="while paused"))
            await redraw(pilot, app, 24)
            assert "PAUSED (2 events since)" in static_text(app, "#status")
            assert [row[0] for row in table_rows(app)] == ["c1", "m1"]  # the view is frozen
            assert app.state.num_events == 24  # while the events are still read
            await pilot.press("p")
            assert "PAUSED" not in static_text(app, "#status")
            assert [row[0] for row in table_rows(app)] == ["c1", "m1", "c2"]
            log_lines = [strip.text for strip in app.query_one("#log", RichLog).lines]
            assert any("while paused" in line for line in log_lines)

            titles = []
            for _ in range(3):
                await pilot.press("f")
                titles.append(app.query_one("#live", DataTable).border_title)
                if app.api_filter == "chat":
                    assert [row[0] for row in table_rows(app)] == ["c1", "c2"]
                if app.api_filter == "messages":
                    assert [row[0] for row in table_rows(app)] == ["m1"]
            assert [str(t).split(" · ")[-1] for t in titles] == [
                "API: chat",
                "API: messages",
                "API: all",
            ]
            assert len(table_rows(app)) == 3

            keys = {key for key, active in app.active_bindings.items() if active.binding.show}
            assert {"p", "f", "q"} <= keys  # what the footer lists
            await pilot.press("q")
        assert app.return_code == 0 and not app.is_running

    asyncio.run(scenario())


def test_a_flood_of_events_costs_a_few_redraws_not_one_each() -> None:
    async def scenario() -> None:
        bus = EventBus()
        bus.bind_loop()
        app = Dashboard(bus.subscribe(capacity=1024), clock=lambda: T0, refresh_s=0.1)
        async with app.run_test(size=(120, 40)) as pilot:
            renders_before = app.num_renders
            for number in range(2000):  # more than the queue holds: the rest are dropped
                bus.publish(events.Log(time=T0, level="info", logger="x", message=str(number)))
            await until(lambda: app.state.num_dropped == 2000 - 1024)
            await pilot.pause(0.35)
            assert app.state.num_events == 1025  # 1024 logs and one Dropped
            assert 1 <= app.num_renders - renders_before <= 8
            assert "976 dropped" in static_text(app, "#status")  # drawn by the timer

    asyncio.run(scenario())


def test_an_ended_stream_is_shown_not_raised() -> None:
    async def stream():
        yield phase(1)
        raise RuntimeError("bus gone")

    async def scenario() -> None:
        app = Dashboard(stream(), refresh_s=60)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(lambda: app.stream_ended)
            app.refresh_view()
            await pilot.pause()
            assert "event stream ended" in static_text(app, "#status")
            assert "bus gone" in app.state.logs[-1].message

    asyncio.run(scenario())


def test_run_dashboard_without_a_terminal_returns_and_leaves_the_bus(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(dashboard, "_has_terminal", lambda: False)

    async def scenario() -> None:
        bus = EventBus()
        bus.bind_loop()
        subscription = bus.subscribe()
        with caplog.at_level(logging.WARNING, logger="metrale.tui.dashboard"):
            assert await run_dashboard(subscription, "metrale") is False
        assert subscription.closed and not bus.has_subscribers

    asyncio.run(scenario())
    assert "needs a terminal" in caplog.text


def test_run_dashboard_logs_a_textual_failure_instead_of_raising(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(self: Dashboard, **kwargs: object) -> None:
        raise OSError("terminal went away")

    monkeypatch.setattr(dashboard, "_has_terminal", lambda: True)
    monkeypatch.setattr(Dashboard, "run_async", broken)

    async def scenario() -> None:
        bus = EventBus()
        bus.bind_loop()
        subscription = bus.subscribe()
        with caplog.at_level(logging.ERROR, logger="metrale.tui.dashboard"):
            assert await run_dashboard(subscription, "metrale") is False
        assert subscription.closed

    asyncio.run(scenario())
    assert "the dashboard failed" in caplog.text and "terminal went away" in caplog.text


def test_the_screenshot_script_still_runs(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("tui_screenshot", SCREENSHOT_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = asyncio.run(module.take_screenshot(tmp_path / "shots" / "tui.svg"))
    svg = out.read_text()
    assert svg.lstrip().startswith("<svg") and "decoding" in svg and "req-0012" in svg
