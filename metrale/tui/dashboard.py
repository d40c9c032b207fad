"""`Dashboard`: the textual app `met serve --tui` shows, and `run_dashboard`, which runs it.

The app reads telemetry events in a worker and folds each into a `DashboardState`; a timer
redraws every area from that state a few times a second. So the cost of drawing does not grow
with the event rate, and thousands of events a second cost a dict update each. The drawing
itself, from a state to rich renderables, lives in `metrale.tui.widgets`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterable, Callable
from typing import ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, ProgressBar, RichLog, Sparkline, Static

from metrale.telemetry.bus import Subscription
from metrale.telemetry.events import Event
from metrale.tui import widgets
from metrale.tui.state import TUI_LOGGER, DashboardState

logger = logging.getLogger(__name__)

REFRESH_S = 0.25  # the view redraws at most four times a second
MAX_TABLE_ROWS = 200  # live requests drawn; the rest are counted in the table's title
EVENTS_PER_YIELD = 256  # the reader lets the loop run between batches of queued events


class Dashboard(App[None]):
    """Startup phases, then load, throughput, latencies, live requests and logs.

    Owns a `DashboardState` that only the event worker writes. The widgets show what the state
    held at the last redraw; while paused they keep showing it, and the worker keeps reading so
    the subscription does not fill up.
    """

    TITLE = "metrale"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("p", "toggle_pause", "pause/resume"),
        Binding("f", "cycle_filter", "filter by API"),
        Binding("q", "quit", "quit (stops the server)"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
    ]
    CSS = """
    #status { height: 1; padding: 0 1; background: $boost; }
    #phases { height: auto; border: round $primary; padding: 0 1; }
    #phase-progress { margin-top: 1; }
    #metrics { height: 7; }
    #load, #throughput, #latency { width: 1fr; height: 7; border: round $primary; padding: 0 1; }
    #live { height: 1fr; border: round $primary; }
    #log { height: 10; border: round $primary; overflow-y: auto; }
    """

    def __init__(
        self,
        events: AsyncIterable[Event],
        title: str = "metrale",
        *,
        clock: Callable[[], float] = time.time,
        refresh_s: float = REFRESH_S,
    ) -> None:
        """`events`: a bus `Subscription` or any async iterable of events. `clock`: the wall
        clock (Unix seconds, like event times) that request ages and the latency window use."""
        super().__init__()
        self.title = title
        self.state = DashboardState()
        self._events = events
        self._clock = clock
        self._refresh_s = refresh_s
        self.paused = False
        self.api_filter: str | None = None  # None: every API
        self.stream_ended = False
        self.num_renders = 0
        self._num_events_at_pause = 0
        self._num_logs_shown = 0
        self._last_render_error = ""
        self._live_cells: dict[str, tuple[str | Text, ...]] = {}  # the table's rows, as drawn

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        with Vertical(id="phases"):
            yield Static(id="phase-table")
            yield ProgressBar(id="phase-progress", show_eta=False)
        with Horizontal(id="metrics"):
            yield Static(id="load")
            with Vertical(id="throughput"):
                yield Static(id="prompt-rate")
                yield Sparkline(id="prompt-spark")
                yield Static(id="generation-rate")
                yield Sparkline(id="generation-spark")
            yield Static(id="latency")
        yield DataTable(id="live", cursor_type="none", zebra_stripes=True)
        yield RichLog(id="log", max_lines=1000, wrap=True, markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#phases").border_title = "startup"
        self.query_one("#load").border_title = "load"
        self.query_one("#throughput").border_title = "throughput"
        self.query_one("#latency").border_title = "latency"
        self.query_one("#log").border_title = "log"
        table = self.query_one("#live", DataTable)
        for label in widgets.LIVE_COLUMNS:
            table.add_column(label, key=label)
        self.run_worker(self._consume(), name="events", exit_on_error=False)
        self.set_interval(self._refresh_s, self.refresh_view)
        self.refresh_view()

    async def _consume(self) -> None:
        num_since_yield = 0
        try:
            async for event in self._events:
                self.state.apply(event)
                num_since_yield += 1
                if num_since_yield >= EVENTS_PER_YIELD:
                    num_since_yield = 0
                    await asyncio.sleep(0)
        except Exception as exc:
            self.state.add_log("error", TUI_LOGGER, f"the event stream failed: {exc!r}")
        self.stream_ended = True

    # -- keys ----------------------------------------------------------------------------------

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self._num_events_at_pause = self.state.num_events
        self.refresh_view()

    def action_cycle_filter(self) -> None:
        """Show the live requests of one API at a time, in name order, then all again."""
        choices: list[str | None] = [None, *sorted(self.state.apis)]
        position = choices.index(self.api_filter) if self.api_filter in choices else 0
        self.api_filter = choices[(position + 1) % len(choices)]
        # A key the user pressed shows at once, even while paused.
        self._guarded(lambda: self._draw_live(reset=True))

    # -- drawing -------------------------------------------------------------------------------

    def refresh_view(self) -> None:
        """Redraw from the state: the status line always, the rest unless paused."""
        self.num_renders += 1
        self._guarded(self._draw_status)
        if not self.paused:
            self._guarded(self._draw_all)

    def _guarded(self, draw: Callable[[], None]) -> None:
        try:
            draw()
        except Exception as exc:  # a drawing bug must not take the dashboard down
            message = f"could not draw the dashboard: {exc!r}"
            if message != self._last_render_error:
                self._last_render_error = message
                self.state.add_log("error", TUI_LOGGER, message)

    def _draw_status(self) -> None:
        num_since_pause = self.state.num_events - self._num_events_at_pause
        text = widgets.status_text(
            self.state,
            self.title,
            paused_events=num_since_pause if self.paused else None,
            stream_ended=self.stream_ended,
        )
        self.query_one("#status", Static).update(text)

    def _draw_all(self) -> None:
        state, now_s = self.state, self._clock()
        self._draw_phases()
        self.query_one("#load", Static).update(widgets.load_text(state))
        prompt_rates, generation_rates = state.prompt_tokens_per_s, state.generation_tokens_per_s
        self.query_one("#prompt-rate", Static).update(widgets.rate_text("prompt", prompt_rates))
        self.query_one("#prompt-spark", Sparkline).data = list(prompt_rates)
        self.query_one("#generation-rate", Static).update(
            widgets.rate_text("generation", generation_rates)
        )
        self.query_one("#generation-spark", Sparkline).data = list(generation_rates)
        self.query_one("#latency", Static).update(widgets.latency_table(state, now_s))
        self._draw_live()
        log = self.query_one("#log", RichLog)
        width = log.scrollable_content_region.width or None  # wrap to the pane, not the console
        for line in state.logs_since(self._num_logs_shown):
            log.write(widgets.log_text(line), width=width)
        self._num_logs_shown = state.num_logs

    def _draw_phases(self) -> None:
        state = self.state
        progress = self.query_one("#phase-progress", ProgressBar)
        self.query_one("#phase-table", Static).update(widgets.phases_renderable(state))
        progress.display = not state.serving and state.num_phases > 0
        if state.num_phases:
            progress.update(total=state.num_phases, progress=state.num_phases_done)

    def _draw_live(self, *, reset: bool = False) -> None:
        """Bring the table to the state's live requests, row by row, so its scroll position
        survives the redraw; `reset` (a new filter) starts it afresh."""
        table = self.query_one("#live", DataTable)
        rows = self.state.live_rows(self.api_filter)
        shown = rows[:MAX_TABLE_ROWS]
        if reset:
            table.clear()
            self._live_cells.clear()
        wanted = {row.request_id for row in shown}
        for request_id in [rid for rid in self._live_cells if rid not in wanted]:
            table.remove_row(request_id)
            del self._live_cells[request_id]
        now_s = self._clock()
        for row in shown:
            cells = widgets.live_cells(row, now_s)
            drawn = self._live_cells.get(row.request_id)
            if drawn is None:
                table.add_row(*cells, key=row.request_id)
            else:
                for column, cell, old in zip(widgets.LIVE_COLUMNS, cells, drawn, strict=True):
                    if cell != old:
                        table.update_cell(row.request_id, column, cell, update_width=True)
            self._live_cells[row.request_id] = cells
        table.border_title = widgets.live_title(len(rows), MAX_TABLE_ROWS, self.api_filter)


def _has_terminal() -> bool:
    """textual reads keys from stdin and draws on stderr: both must be a terminal."""
    streams = (sys.__stdin__, sys.__stderr__)
    return all(stream is not None and stream.isatty() for stream in streams)


async def run_dashboard(events: AsyncIterable[Event], title: str = "metrale") -> bool:
    """Show the dashboard in this terminal until the user quits or the terminal goes away.

    Returns normally in every case but cancellation, so the caller keeps serving after it: with
    no terminal it logs why and returns at once; a failure inside textual is logged, not raised.
    Returns True only when the user quit (`q`, Ctrl+C): the server then stops, as Ctrl+C stops
    it without the dashboard. A `Subscription` passed in is closed on the way out, so the bus
    stops feeding it.
    """
    try:
        if not _has_terminal():
            logger.warning(
                "--tui needs a terminal but stdin or stderr is not one: serving without the "
                "dashboard (run in a terminal, or drop --tui and read the logs)"
            )
            return False
        app = Dashboard(events, title)
        try:
            await app.run_async()
        except Exception:
            logger.exception("the dashboard failed; the server keeps serving")
            return False
        if app.return_code:
            logger.warning(
                "the dashboard closed with return code %s; the server keeps serving",
                app.return_code,
            )
            return False
        return True
    finally:
        if isinstance(events, Subscription):
            events.close()
