"""`met bench certify`: a fixed suite (batch-1 decode, a concurrency ladder, the prefix cache, a
long context) run against `met serve`, judged by the thresholds of this machine's box class.

    met bench certify                      # starts met serve on the built-in model, judges it
    met bench certify --base-url URL       # a server already running
    met bench certify --calibrate NAME     # also write a box entry from this run's figures

Each check is a `met bench serve` run whose arguments the suite names (`certify.toml`, shipped
with Metrale; `--suite FILE` for another). It prints pass or fail per threshold and writes
`report.md` with the figures, `certify.json` with every run, and the server's log when it
started one. Exit status: 0 when every threshold holds, 1 when one does not, 2 when there is
no threshold for this box and model (the figures are still written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx

from metrale.entrypoints.cli.bench import report
from metrale.entrypoints.cli.bench import serve as bench_serve
from metrale.entrypoints.cli.bench.certify_suite import (
    Box,
    Suite,
    Verdict,
    calibrated_box,
    judge,
    measure,
)
from metrale.entrypoints.cli.bench.server_process import ServerProcess
from metrale.entrypoints.cli.bench.workload import metadata


def add_certify_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target")
    g.add_argument(
        "--base-url",
        metavar="URL",
        help="certify a server already running (default: start met serve with the box's "
        "serve_args, the built-in model, on a free loopback port)",
    )
    g.add_argument(
        "--serve-args",
        metavar="ARGS",
        help="start met serve with these arguments instead of the box's, e.g. "
        "'Qwen/Qwen3-0.6B --max-seq-len 4096' (the thresholds hold only for the box's model)",
    )
    g.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long the started server may take to come up (default 600)",
    )
    g.add_argument("--tokenizer", help="count tokens with this (default: the served model's)")
    g = parser.add_argument_group("suite")
    g.add_argument("--suite", type=Path, help="a certify.toml of your own (default: Metrale's)")
    g.add_argument("--box", help="judge by this box class of the suite instead of the matched one")
    g.add_argument(
        "--checks", metavar="NAME[,NAME...]", help="run only these checks (default: all)"
    )
    g.add_argument(
        "--calibrate",
        metavar="NAME",
        help="also write a [[box]] entry named NAME for this machine from this run's figures "
        "(calibration.toml in the report directory)",
    )
    g = parser.add_argument_group("results")
    g.add_argument(
        "--report",
        type=Path,
        default=Path("certify-report"),
        metavar="DIR",
        help="where report.md, certify.json, the figures and the server log go "
        "(default ./certify-report)",
    )


def run_certify(args: argparse.Namespace) -> int:
    suite = Suite.load(args.suite)
    checks = suite.checks
    if args.checks:
        wanted = [c.strip() for c in args.checks.split(",") if c.strip()]
        unknown = sorted(set(wanted) - {c.name for c in checks})
        if unknown:
            raise ValueError(f"--checks: no check {', '.join(unknown)} in {suite.source}")
        checks = tuple(c for c in checks if c.name in wanted)
    args.report.mkdir(parents=True, exist_ok=True)
    if args.base_url:
        hardware = _remote_hardware(args.base_url)
        box = _pick_box(suite, hardware, args.box)
        doc = asyncio.run(_certify(args, suite, checks, box, args.base_url.rstrip("/"), hardware))
    else:
        from metrale import hardware as local

        hardware = local.describe()
        box = _pick_box(suite, hardware, args.box)
        if args.serve_args is not None:
            serve_args = shlex.split(args.serve_args)
        else:
            serve_args = list(box.serve_args) if box else []
        log = args.report / "serve.log"
        print(f"starting met serve {shlex.join(serve_args)} (log: {log})", file=sys.stderr)
        with ServerProcess(serve_args, log, start_timeout=args.start_timeout) as server:
            doc = asyncio.run(_certify(args, suite, checks, box, server.base_url, hardware))
        doc["serve_args"] = serve_args
    return _finish(args, doc, box)


def _pick_box(suite: Suite, hardware: dict[str, Any], name: str | None) -> Box | None:
    if name is None:
        return suite.box_for(hardware)
    box = next((b for b in suite.boxes if b.name == name), None)
    if box is None:
        known = ", ".join(b.name for b in suite.boxes) or "none"
        raise ValueError(f"--box {name!r}: {suite.source} has no such box (it has: {known})")
    return box


def _remote_hardware(base_url: str) -> dict[str, Any]:
    """The server's /hardware (a Metrale server's); else this machine's, as the benchmark
    drives loopback servers."""
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/hardware", timeout=10)
        if response.status_code == 200:
            return response.json()
    except (httpx.HTTPError, ValueError):
        pass
    from metrale import hardware as local

    return local.describe()


async def _certify(
    args: argparse.Namespace,
    suite: Suite,
    checks: tuple,
    box: Box | None,
    base_url: str,
    hardware: dict[str, Any],
) -> dict[str, Any]:
    doc: dict[str, Any] = metadata("met bench certify", args) | {
        "suite": suite.source,
        "hardware": hardware,
        "box": box.name if box else None,
        "checks": [],
    }
    for check in checks:
        print(f"\n== {check.name}: {check.title}", file=sys.stderr)
        entry: dict[str, Any] = {"name": check.name, "title": check.title}
        try:
            baseline = []
            if check.baseline is not None:
                baseline_doc = await _bench(args, list(check.baseline), base_url)
                baseline = baseline_doc["targets"][0]["runs"]
                entry["baseline"] = baseline_doc
            run_doc = await _bench(
                args, box.check_args(check) if box else list(check.args), base_url
            )
            entry["runs"] = run_doc
            target = run_doc["targets"][0]
            doc.setdefault("model", target["model"])
            doc.setdefault("server", target["server"])
            entry["values"] = measure(check, target["runs"], baseline)
        except (ValueError, httpx.HTTPError) as e:
            entry["error"] = str(e)
            entry["values"] = {"failed": None}
            print(f"{check.name}: {e}", file=sys.stderr)
        entry["check"] = check
        doc["checks"].append(entry)
    return doc


async def _bench(args: argparse.Namespace, check_args: list[str], base_url: str) -> dict:
    parser = argparse.ArgumentParser(prog="met bench serve")
    bench_serve.add_arguments(parser)
    extra = ["--base-url", base_url, "--disable-progress"]
    if args.tokenizer:
        extra += ["--tokenizer", args.tokenizer]
    return await bench_serve.bench(parser.parse_args([*check_args, *extra]))


def thresholds_apply(box: Box | None, doc: dict[str, Any]) -> str | None:
    """Why the box's thresholds do not hold for this run; None when they do."""
    if box is None:
        return "no box class of the suite matches this machine"
    if not box.thresholds:
        return f"box {box.name} has no thresholds"
    if box.model and doc.get("model") != box.model:
        return f"box {box.name}'s thresholds are for model {box.model}, not {doc.get('model')}"
    if box.checkpoint and box.checkpoint not in served_checkpoint(doc):
        return f"box {box.name}'s thresholds are for the checkpoint {box.checkpoint}"
    return None


def served_checkpoint(doc: dict[str, Any]) -> str:
    """The checkpoint directory the certified server reports in /serve-config ("" if none)."""
    engine = ((doc.get("server") or {}).get("serve-config") or {}).get("engine") or {}
    return str(engine.get("model_dir") or "")


def _finish(args: argparse.Namespace, doc: dict[str, Any], box: Box | None) -> int:
    why_not = thresholds_apply(box, doc)
    verdicts: list[Verdict] = []
    for entry in doc["checks"]:
        check = entry.pop("check")
        if "error" in entry:
            verdicts.append(Verdict(check.name, "ran", None, "min", 1))
            continue
        verdicts += judge(check, entry["values"], None if why_not else box)
    doc["thresholds_apply"] = why_not is None
    doc["no_thresholds_because"] = why_not
    doc["verdicts"] = [
        {
            "check": v.check,
            "metric": v.metric,
            "value": v.value,
            "bound": v.bound,
            "threshold": v.threshold,
            "passed": v.passed,
        }
        for v in verdicts
    ]
    ladder = next((e["runs"] for e in doc["checks"] if e["name"] == "ladder" and "runs" in e), None)
    figures = []
    if ladder:
        try:
            figures = report.plot([ladder], args.report)
        except ImportError as e:  # a trimmed install: the verdict does not need the figures
            print(f"no figures: {e}", file=sys.stderr)
    if args.calibrate:
        values = {e["name"]: e["values"] for e in doc["checks"] if "error" not in e}
        box_entry = calibrated_box(
            args.calibrate,
            doc["hardware"],
            doc.get("model", ""),
            doc.get("serve_args", []),
            values,
            f"met bench certify {doc['date']} {doc.get('git_sha') or ''}".strip(),
        )
        (args.report / "calibration.toml").write_text(box_entry)
        print(f"\n{box_entry}", file=sys.stderr)
    (args.report / "certify.json").write_text(json.dumps(doc, indent=1, default=str))
    markdown = report.certify_markdown(doc, [p.name for p in figures])
    (args.report / "report.md").write_text(markdown)
    print("\n" + report.verdict_table(doc["verdicts"]))
    failed = [v for v in verdicts if not v.passed]
    if failed:
        print(f"\nFAIL: {len(failed)} of {len(verdicts)} checks; report in {args.report}")
        return 1
    if why_not:
        print(f"\nno verdict: {why_not}; figures in {args.report}")
        return 0 if args.calibrate else 2
    print(f"\nPASS: {len(verdicts)} checks on box {box.name}; report in {args.report}")
    return 0
