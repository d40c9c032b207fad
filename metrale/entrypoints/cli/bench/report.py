"""How a benchmark shows what it measured: vLLM's result block on the terminal, a rich progress
bar while it runs, a side-by-side table of several result files, and matplotlib figures."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from metrale.entrypoints.cli.bench.metrics import LATENCIES, percentile_label

TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@contextlib.contextmanager
def progress(total: int, *, disabled: bool) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr over `total` requests; yields the function that advances it."""
    if disabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with bar:
        task = bar.add_task("requests", total=total)
        yield lambda: bar.advance(task)


def summary_table(row: dict[str, Any], percentiles: Sequence[float]) -> str:
    """One run in `vllm bench serve`'s layout."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def add(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:<10}")

    add("Successful requests:", row["completed"])
    add("Failed requests:", row["failed"])
    add("Maximum request concurrency:", row["max_concurrency"] or "none")
    add("Request rate (req/s):", row["request_rate"])
    add("Benchmark duration (s):", row["duration"])
    add("Total input tokens:", row["total_input_tokens"])
    add("Total generated tokens:", row["total_output_tokens"])
    add("Request throughput (req/s):", row["request_throughput"])
    if "request_goodput" in row:
        add("Request goodput (req/s):", row["request_goodput"])
    add("Output token throughput (tok/s):", row["output_throughput"])
    add("Total token throughput (tok/s):", row["total_token_throughput"])
    for name in LATENCIES:
        lines.append("{s:{c}^{n}}".format(s=TITLES[name], n=50, c="-"))
        upper = name.upper()
        add(f"Mean {upper} (ms):", row[f"mean_{name}_ms"])
        add(f"Median {upper} (ms):", row[f"median_{name}_ms"])
        add(f"Std {upper} (ms):", row[f"std_{name}_ms"])
        for p in percentiles:
            label = percentile_label(p)
            add(f"P{label} {upper} (ms):", row[f"p{label}_{name}_ms"])
        if name == "itl" and "mean_itl_per_token_ms" in row:
            add("Mean ITL per token (ms):", row["mean_itl_per_token_ms"])
        if f"server_mean_{name}_ms" in row:
            add(f"Server's mean {upper} (ms):", row[f"server_mean_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def runs(docs: Sequence[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(target label, run) over every target of every result file."""
    for doc in docs:
        for target in doc.get("targets", []):
            for run in target.get("runs", []):
                yield target["name"], run


def comparison_table(docs: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'target':<24}{'rate':>8}{'conc':>6}{'ok':>6}{'out tok/s':>11}"
        f"{'TTFT ms':>10}{'TPOT ms':>10}{'ITL ms':>10}{'E2EL ms':>10}"
    )
    lines = [header, "-" * len(header)]
    for name, run in runs(docs):
        lines.append(
            f"{name[:23]:<24}{run['request_rate']!s:>8}{run['max_concurrency'] or '-'!s:>6}"
            f"{run['completed']:>6}{run['output_throughput']:>11.1f}"
            f"{run['mean_ttft_ms']:>10.1f}{run['mean_tpot_ms']:>10.2f}"
            f"{run['mean_itl_ms']:>10.2f}{run['mean_e2el_ms']:>10.1f}"
        )
    return "\n".join(lines)


def plot(docs: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Latency percentiles against request rate, throughput against concurrency and the TTFT
    distribution, each target one colour; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    by_target: dict[str, list[dict[str, Any]]] = {}
    for name, run in runs(docs):
        by_target.setdefault(name, []).append(run)
    written = []

    finite = [_rate(r["request_rate"]) for rows in by_target.values() for r in rows]
    finite = [x for x in finite if math.isfinite(x)]
    inf_at = 2 * max(finite) if finite else 1.0  # where rate inf is drawn

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, name in zip(axes.flat, LATENCIES, strict=True):
        for i, (target, rows) in enumerate(by_target.items()):
            rows = sorted(rows, key=lambda r: _rate(r["request_rate"]))
            xs = [min(_rate(r["request_rate"]), inf_at) for r in rows]
            for style, stat in (("-", "median"), ("--", "p90"), (":", "p99")):
                key = f"{stat}_{name}_ms"
                if all(key in r for r in rows):
                    ax.plot(
                        xs,
                        [r[key] for r in rows],
                        style,
                        marker="o",
                        color=f"C{i}",
                        label=f"{target} {stat}",
                    )
        ax.set_title(TITLES[name])
        ax.set_xlabel("request rate (req/s; inf drawn at the right)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    written.append(_save(fig, out_dir / "latency_vs_request_rate.png"))

    fig, ax = plt.subplots(figsize=(7, 5))
    for i, (target, rows) in enumerate(by_target.items()):
        rows = sorted(rows, key=lambda r: r["max_concurrency"] or math.inf)
        xs = [r["max_concurrency"] or r["num_prompts"] for r in rows]
        ax.plot(xs, [r["output_throughput"] for r in rows], marker="o", color=f"C{i}", label=target)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency (no cap drawn at the request count)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput against concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir / "throughput_vs_concurrency.png"))

    fig, ax = plt.subplots(figsize=(7, 5))
    for i, (target, rows) in enumerate(by_target.items()):
        for j, r in enumerate(rows):
            ttfts = sorted(1e3 * t for t in r.get("ttfts", []) if t is not None)
            if ttfts:
                ys = [(k + 1) / len(ttfts) for k in range(len(ttfts))]
                label = f"{target} rate {r['request_rate']} conc {r['max_concurrency'] or '-'}"
                ax.step(
                    ttfts,
                    ys,
                    where="post",
                    color=f"C{i}",
                    alpha=1 - 0.6 * j / len(rows),
                    label=label,
                )
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / "ttft_cdf.png"))
    return written


def verdict_table(verdicts: Sequence[dict[str, Any]]) -> str:
    """One line per threshold: the check, the metric, its value against the bound, PASS/FAIL."""
    lines = [f"{'check':<14} {'metric':<22} {'value':>10}   {'threshold':<14} verdict"]
    for v in verdicts:
        sign = ">=" if v["bound"] == "min" else "<="
        lines.append(
            f"{v['check']:<14} {v['metric']:<22} {_figure(v['value']):>10}   "
            f"{sign} {_figure(v['threshold']):<11} {'PASS' if v['passed'] else 'FAIL'}"
        )
    return "\n".join(lines)


def certify_markdown(doc: dict[str, Any], figures: Sequence[str]) -> str:
    """`met bench certify`'s report: the box, the server, each check's figures and verdicts."""
    failed = [v for v in doc["verdicts"] if not v["passed"]]
    if failed:
        outcome = f"**FAIL**: {len(failed)} of {len(doc['verdicts'])} thresholds missed"
    elif doc["no_thresholds_because"]:
        outcome = f"**no verdict**: {doc['no_thresholds_because']}"
    else:
        outcome = f"**PASS**: {len(doc['verdicts'])} thresholds held"
    serve = f"; met serve {' '.join(doc['serve_args'])}" if doc.get("serve_args") else ""
    out = [
        "# met bench certify",
        "",
        outcome,
        "",
        f"- date: {doc['date']}; Metrale {doc['metrale_version']} ({doc.get('git_sha') or '-'})",
        f"- machine: {_machine(doc.get('hardware') or {})}; box class: {doc.get('box') or '-'}",
        f"- model: {doc.get('model')}{serve}",
        f"- suite: {doc['suite']}",
        "",
        "| check | metric | value | threshold | verdict |",
        "|---|---|---|---|---|",
    ]
    for entry in doc["checks"]:
        judged = {v["metric"]: v for v in doc["verdicts"] if v["check"] == entry["name"]}
        for metric in {**entry["values"], **judged}:
            v = judged.get(metric)
            bound = verdict = ""
            if v:
                bound = f"{'>=' if v['bound'] == 'min' else '<='} {_figure(v['threshold'])}"
                verdict = "PASS" if v["passed"] else "**FAIL**"
            value = _figure(entry["values"].get(metric))
            out.append(f"| {entry['name']} | {metric} | {value} | {bound} | {verdict} |")
    for entry in doc["checks"]:
        out += ["", f"## {entry['name']}", "", entry["title"], ""]
        if "error" in entry:
            out.append(f"Did not run: {entry['error']}")
            continue
        out += [
            "| run | concurrency | done | failed | out tok/s | median TTFT ms | median TPOT ms "
            "| p99 ITL ms | server TTFT / TPOT ms | prefix hits |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label, key in (("baseline", "baseline"), ("run", "runs")):
            for r in (entry.get(key) or {"targets": [{"runs": []}]})["targets"][0]["runs"]:
                server = f"{_figure(r.get('server_mean_ttft_ms'))} / "
                server += _figure(r.get("server_mean_tpot_ms"))
                out.append(
                    f"| {label} | {r['max_concurrency'] or '-'} | {r['completed']} | "
                    f"{r['failed']} | {_figure(r['output_throughput'])} | "
                    f"{_figure(r['median_ttft_ms'])} | {_figure(r['median_tpot_ms'])} | "
                    f"{_figure(r['p99_itl_ms'])} | {server} | "
                    f"{_figure(r.get('server_prefix_cache_hit_rate'))} |"
                )
    out.append("")
    out += [f"![{name}]({name})" for name in figures]
    return "\n".join(out) + "\n"


def _machine(hardware: dict[str, Any]) -> str:
    cpu = hardware.get("cpu") or {}
    parts = [f"{cpu.get('cores')} CPU cores ({cpu.get('model')})"]
    parts += [
        f"{g['name']} ({g['memory_total_bytes'] / 2**30:.0f} GiB)"
        for g in hardware.get("gpus") or []
    ]
    return ", ".join(parts)


def _figure(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _rate(value: Any) -> float:
    return math.inf if value == "inf" else float(value)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
