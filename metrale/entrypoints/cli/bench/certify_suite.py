"""The certification suite as data (`certify.toml`): its checks, the box classes with their
thresholds, what a check measures from its runs, the verdict against a box's thresholds, and a
new box's entry calibrated from a run."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

# derived metrics; any other name is a key of the check's last run
DERIVED = ("scaling", "ttft_speedup", "prefix_cache_hit_rate", "failed")
# a calibrated threshold's slack: a throughput at least this share of the calibration run's, a
# latency at most its inverse times the run's
MARGIN = 0.75
_MATCH_KEYS = ("gpus", "gpu_name", "min_gpu_memory_gib", "min_cores", "max_cores")


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    args: tuple[str, ...]
    measure: tuple[str, ...]
    baseline: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Box:
    name: str
    description: str
    match: dict[str, Any]
    model: str | None = None  # the served model name the thresholds hold for
    checkpoint: str | None = None  # ... and a part of its checkpoint's path (/serve-config)
    serve_args: tuple[str, ...] = ()  # what certify starts `met serve` with
    args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # per check, appended
    thresholds: dict[str, dict[str, float]] = field(default_factory=dict)
    calibrated_from: str = ""

    def matches(self, hardware: dict[str, Any]) -> bool:
        gpus = hardware.get("gpus") or []
        cores = (hardware.get("cpu") or {}).get("cores") or 0
        m = self.match
        if "gpus" in m and len(gpus) != m["gpus"]:
            return False
        if "gpu_name" in m and not (gpus and m["gpu_name"].lower() in gpus[0]["name"].lower()):
            return False
        if "min_gpu_memory_gib" in m and not (
            gpus and gpus[0]["memory_total_bytes"] >= m["min_gpu_memory_gib"] * 2**30
        ):
            return False
        return m.get("min_cores", 0) <= cores <= m.get("max_cores", math.inf)

    def check_args(self, check: Check) -> list[str]:
        return [*check.args, *self.args.get(check.name, ())]


@dataclass(frozen=True)
class Suite:
    checks: tuple[Check, ...]
    boxes: tuple[Box, ...]
    source: str

    @classmethod
    def load(cls, path: Path | None = None) -> Suite:
        """The suite in `path`, or the one shipped with Metrale."""
        if path is None:
            ref = resources.files("metrale.entrypoints.cli.bench") / "certify.toml"
            text, source = ref.read_text(), "metrale/entrypoints/cli/bench/certify.toml"
        else:
            text, source = path.read_text(), str(path)
        try:
            return cls.parse(tomllib.loads(text), source)
        except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: not a certify suite: {e}") from None

    @classmethod
    def parse(cls, doc: dict[str, Any], source: str) -> Suite:
        checks = tuple(
            Check(
                name=c["name"],
                title=c.get("title", c["name"]),
                args=tuple(c["args"]),
                measure=tuple(c.get("measure", ())),
                baseline=tuple(c["baseline"]) if "baseline" in c else None,
            )
            for c in doc.get("check", [])
        )
        names = {c.name for c in checks}
        boxes = []
        for b in doc.get("box", []):
            unknown = set(b.get("match", {})) - set(_MATCH_KEYS)
            if unknown:
                raise ValueError(f"box {b['name']!r}: unknown match keys {sorted(unknown)}")
            for section in ("args", "thresholds"):
                stray = set(b.get(section, {})) - names
                if stray:
                    raise ValueError(f"box {b['name']!r}: {section} for no check: {sorted(stray)}")
            for check, bounds in b.get("thresholds", {}).items():
                for key in bounds:
                    if not key.startswith(("min_", "max_")):
                        raise ValueError(f"box {b['name']!r}: {check}.{key}: use min_ or max_")
            boxes.append(
                Box(
                    name=b["name"],
                    description=b.get("description", ""),
                    match=dict(b.get("match", {})),
                    model=b.get("model"),
                    checkpoint=b.get("checkpoint"),
                    serve_args=tuple(b.get("serve_args", ())),
                    args={k: tuple(v) for k, v in b.get("args", {}).items()},
                    thresholds={k: dict(v) for k, v in b.get("thresholds", {}).items()},
                    calibrated_from=b.get("calibrated_from", ""),
                )
            )
        if not checks:
            raise ValueError("no [[check]]")
        return cls(checks, tuple(boxes), source)

    def box_for(self, hardware: dict[str, Any]) -> Box | None:
        return next((b for b in self.boxes if b.matches(hardware)), None)


def measure(check: Check, runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict:
    """Every metric `check` names, from its runs (and its baseline's), plus `failed`."""
    last = runs[-1]
    values: dict[str, float | None] = {}
    for name in check.measure:
        if name == "scaling":
            first = runs[0]["output_throughput"]
            values[name] = last["output_throughput"] / first if first else None
        elif name == "ttft_speedup":
            base = baseline[-1]["median_ttft_ms"] if baseline else None
            values[name] = (
                base / last["median_ttft_ms"] if base and last["median_ttft_ms"] else None
            )
        elif name == "prefix_cache_hit_rate":
            values[name] = last.get("server_prefix_cache_hit_rate")
        elif name != "failed":
            values[name] = last.get(name)
    values["failed"] = sum(r["failed"] for r in [*runs, *baseline])
    return values


@dataclass(frozen=True)
class Verdict:
    check: str
    metric: str
    value: float | None
    bound: str  # "min" or "max"
    threshold: float

    @property
    def passed(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.threshold if self.bound == "min" else self.value <= self.threshold


def judge(check: Check, values: dict[str, Any], box: Box | None) -> list[Verdict]:
    """The check's values against the box's thresholds; no request may fail."""
    verdicts = [Verdict(check.name, "failed", values["failed"], "max", 0)]
    for key, threshold in (box.thresholds.get(check.name, {}) if box else {}).items():
        bound, metric = key.split("_", 1)
        verdicts.append(Verdict(check.name, metric, values.get(metric), bound, threshold))
    return verdicts


def calibrated_box(
    name: str,
    hardware: dict[str, Any],
    model: str,
    serve_args: list[str],
    values: dict[str, dict[str, Any]],
    source: str,
) -> str:
    """A `[[box]]` entry for certify.toml: this machine's class, and thresholds at MARGIN of
    the values measured (a larger-is-better metric's floor, a latency's ceiling)."""
    gpus = hardware.get("gpus") or []
    cores = (hardware.get("cpu") or {}).get("cores") or 0
    if gpus:
        memory_gib = math.floor(gpus[0]["memory_total_bytes"] / 2**30)
        match = {"gpus": len(gpus), "gpu_name": gpus[0]["name"], "min_gpu_memory_gib": memory_gib}
        description = f"{len(gpus)} x {gpus[0]['name']} ({memory_gib} GiB)"
    else:
        match = {"gpus": 0, "min_cores": cores, "max_cores": cores}
        description = f"{cores} CPU cores ({(hardware.get('cpu') or {}).get('model', '?')}), no GPU"
    lines = [
        "[[box]]",
        f"name = {_toml(name)}",
        f"description = {_toml(description)}",
        f"match = {_toml(match)}",
        f"model = {_toml(model)}",
        f"serve_args = {_toml(serve_args)}",
        f"calibrated_from = {_toml(source)}",
        "[box.thresholds]",
    ]
    for check, measured in values.items():
        bounds = {}
        for metric, value in measured.items():
            if metric == "failed" or value is None:
                continue
            if metric.endswith("_ms"):
                bounds[f"max_{metric}"] = _round(value / MARGIN)
            else:
                bounds[f"min_{metric}"] = _round(value * MARGIN)
        lines.append(f"{check} = {_toml(bounds)}")
    return "\n".join(lines) + "\n"


def _round(x: float) -> float:
    """Three significant figures."""
    return float(f"{x:.3g}")


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")
