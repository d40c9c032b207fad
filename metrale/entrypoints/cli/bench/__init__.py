"""`met bench` (alias `met benchmark`): measure a server or the engine.

- `serve`: drive OpenAI- or Anthropic-compatible servers (`serve.py`);
- `offline` and `latency`: the in-process engine, like `vllm bench throughput` and
  `vllm bench latency` (`offline.py`);
- `certify`: a fixed suite of `serve` runs judged by per-box thresholds (`certify.py`; the suite
  and thresholds are data, `certify.toml`, read by `certify_suite.py`);

The metric math is plain functions in `metrics.py`; datasets in `datasets.py`.
"""

from __future__ import annotations

import argparse
import importlib

from metrale.entrypoints.cli import Subcommand, register

MODES = {
    "serve": "drive OpenAI- or Anthropic-compatible servers and report vLLM's serving metrics",
    "offline": "the in-process engine's throughput on a dataset (like vllm bench throughput)",
    "latency": "the in-process engine's batch latency (like vllm bench latency)",
    "certify": "a fixed suite against met serve, judged by this box class's thresholds",
}
_MODULES = {"serve": "serve", "offline": "offline", "latency": "offline", "certify": "certify"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    modes = parser.add_subparsers(
        dest="mode", metavar="MODE", required=True, help="what to measure"
    )
    for mode, help_text in MODES.items():
        module = _module(mode)
        sub = modes.add_parser(mode, help=help_text, description=help_text)
        adder = getattr(module, f"add_{mode}_arguments", None) or module.add_arguments
        adder(sub)
        sub.set_defaults(bench_run=getattr(module, f"run_{mode}", None) or module.run)


def run(args: argparse.Namespace) -> int:
    return args.bench_run(args)


def _module(mode: str):
    return importlib.import_module(f"{__name__}.{_MODULES[mode]}")


register(
    Subcommand(
        "bench",
        "measure a server or the engine (serve, offline, latency)",
        add_arguments,
        run,
        aliases=("benchmark",),
    )
)
