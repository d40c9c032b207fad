"""How each area of the dashboard draws a `DashboardState`: pure functions to rich renderables.

They read the state and never change it, so the app can call them on a timer and tests can call
them on a hand-made state. Text from events (log messages, request ids) goes in as plain text,
never as markup, so a message holding `[bold]` prints as written.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from metrale.tui.state import DashboardState, LiveRow, LogLine, Percentiles, PhaseStatus

LIVE_COLUMNS = ("request", "API", "state", "prompt", "cached", "generated", "age")
BAR_WIDTH = 20
_PHASE_STYLES = {
    PhaseStatus.PENDING: "dim",
    PhaseStatus.RUNNING: "bold yellow",
    PhaseStatus.DONE: "green",
}
_LEVEL_STYLES = {"debug": "dim", "warning": "yellow", "error": "bold red", "critical": "bold red"}


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1.0:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds:.2f} s"


def fraction_text(fraction: float | None) -> str:
    return "—" if fraction is None else f"{fraction * 100:.1f}%"


def count_text(count: int | None) -> str:
    return "—" if count is None else f"{count:,}"


def bar_text(fraction: float | None, width: int = BAR_WIDTH) -> Text:
    """A bar of `width` cells, filled to `fraction` (0..1), rounded to the nearest cell."""
    filled = 0 if fraction is None else round(min(1.0, max(0.0, fraction)) * width)
    style = "green" if fraction is None or fraction < 0.7 else "yellow"
    if fraction is not None and fraction >= 0.9:
        style = "bold red"
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"))


def status_text(
    state: DashboardState, title: str, *, paused_events: int | None, stream_ended: bool
) -> Text:
    """The top line: title, what the server is doing, events read and lost, pause."""
    phase = "serving" if state.serving else "starting"
    text = Text.assemble((title, "bold"), "  ", phase, f"  ·  {state.num_events:,} events")
    if state.num_dropped:
        text.append(f"  ·  {state.num_dropped:,} dropped", style="bold yellow")
    if state.num_ignored:
        text.append(f"  ·  {state.num_ignored:,} ignored", style="yellow")
    if stream_ended:
        text.append("  ·  event stream ended", style="bold red")
    if paused_events is not None:
        text.append(f"  ·  PAUSED ({paused_events:,} events since)", style="bold reverse")
    return text


def phases_renderable(state: DashboardState) -> RenderableType:
    """While starting, a table of every phase; once serving, one summary line."""
    rows = state.phase_rows()
    if not rows:
        return Text("waiting for the server's startup phases…", style="dim")
    if state.serving:
        done = [row for row in rows if row.status is PhaseStatus.DONE]
        text = Text.assemble(
            ("startup ", "bold"),
            f"{len(done)}/{len(rows)} phases done in {duration_text(state.startup_s)}",
        )
        slowest = max(done, key=lambda row: row.duration_s or 0.0, default=None)
        if slowest is not None:
            text.append(f"  ·  slowest: {slowest.name} {duration_text(slowest.duration_s)}")
        return text
    table = Table(box=None, expand=True, pad_edge=False, show_edge=False)
    table.add_column("#", justify="right", width=5)
    table.add_column("phase", ratio=1)
    table.add_column("state", width=8)
    table.add_column("time", justify="right", width=10)
    for row in rows:
        name = Text(row.name or "—")
        if row.detail:
            name.append(f"  {row.detail}", style="dim")
        table.add_row(
            f"{row.index}/{len(rows)}",
            name,
            Text(row.status.value, style=_PHASE_STYLES[row.status]),
            "…" if row.status is PhaseStatus.RUNNING else duration_text(row.duration_s),
        )
    return table


def load_text(state: DashboardState) -> Text:
    """Requests running and waiting, the KV cache's fill, prefix-cache hits, preemptions."""
    return Text.assemble(
        ("running ", "bold"),
        f"{state.running:,}",
        ("   waiting ", "bold"),
        f"{state.waiting:,}\n",
        ("KV cache ", "bold"),
        bar_text(state.kv_cache_usage),
        f" {fraction_text(state.kv_cache_usage)}\n",
        ("prefix-cache hits ", "bold"),
        f"{fraction_text(state.prefix_cache_hit_rate)}\n",
        ("preemptions ", "bold"),
        f"{state.num_preemptions:,}   ",
        ("finished ", "bold"),
        f"{state.num_finished:,}",
    )


def rate_text(label: str, rates: Sequence[float]) -> Text:
    """The label over a sparkline: the latest rate and the peak of the history shown."""
    if not rates:
        return Text.assemble((f"{label} tok/s ", "bold"), "—")
    return Text.assemble(
        (f"{label} tok/s ", "bold"), f"{rates[-1]:,.1f}", (f"  (peak {max(rates):,.1f})", "dim")
    )


def latency_table(state: DashboardState, now_s: float) -> RenderableType:
    """TTFT and ITL p50 / p99 over the last minute (see `DashboardState.ttft` and `itl`)."""
    ttft, itl = state.ttft(now_s), state.itl(now_s)
    table = Table(box=None, expand=True, pad_edge=False, show_edge=False)
    table.add_column("")
    table.add_column("p50", justify="right")
    table.add_column("p99", justify="right")
    table.add_column("n", justify="right")
    for name, figures in (("TTFT", ttft), ("ITL", itl)):
        table.add_row(name, *_percentile_cells(figures))
    note = Text("requests finished in the last 60 s", style="dim")
    return Group(table, note)


def _percentile_cells(figures: Percentiles) -> tuple[str, str, str]:
    return (
        duration_text(figures.p50_s),
        duration_text(figures.p99_s),
        f"{figures.num_samples:,}",
    )


def live_cells(row: LiveRow, now_s: float) -> tuple[str | Text, ...]:
    """One live request as the table's cells, in `LIVE_COLUMNS` order."""
    age_s = row.age_s(now_s)
    return (
        row.request_id,
        row.api,
        row.status.value,
        Text(count_text(row.prompt_tokens), justify="right"),
        Text(count_text(row.cached_tokens), justify="right"),
        Text(count_text(row.generated_tokens), justify="right"),
        Text("—" if age_s is None else f"{age_s:.1f} s", justify="right"),
    )


def live_title(num_rows: int, max_rows: int, api_filter: str | None) -> str:
    shown = f"{num_rows:,}" if num_rows <= max_rows else f"{num_rows:,}, the oldest {max_rows:,}"
    return f"live requests ({shown}) · API: {api_filter or 'all'}"


def log_text(line: LogLine) -> Text:
    clock = "--:--:--" if line.time_s is None else time.strftime("%H:%M:%S", _local(line.time_s))
    level = line.level.lower()
    return Text.assemble(
        (clock, "dim"),
        " ",
        (f"{level.upper():<7}", _LEVEL_STYLES.get(level, "")),
        " ",
        (line.logger, "cyan"),
        " ",
        line.message,
    )


def _local(time_s: float) -> time.struct_time:
    try:
        return time.localtime(time_s)
    except (OverflowError, OSError, ValueError):  # a time far outside the platform's range
        return time.localtime(0)
