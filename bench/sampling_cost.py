"""Where the time of sampling knobs goes: B2's workload (bench/gpu_suite.py) with a knob on every
request, per step the engine's host time and the device's, and the host's hottest functions.

    python bench/sampling_cost.py [--variants none dry lz ...] [--profile dry] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import warnings
from pathlib import Path

import torch
from gpu_suite import QWEN3_06B, b2_engine, b2_workload, run

from metrale.sampling_params import DryBreakers, SamplingParams

DRY = {"dry_multiplier": 0.8, "dry_breakers": DryBreakers(single=tuple(range(0, 151_936, 40)))}
VARIANTS = {
    "none": {},
    "unseeded": {"seed": None},
    "top_n_sigma": {"top_n_sigma": 1.0},
    "dry": DRY,
    "dry_no_breakers": {"dry_multiplier": 0.8},
    "dry_top_n_sigma": {**DRY, "top_n_sigma": 1.0},
    "lz": {"lz_penalty": 0.15},
    "presence": {"presence_penalty": 0.5},
}


def step_figures(core) -> dict[str, float]:
    stats = [s for s in core.step_stats if s.device_s is not None and s.host_s is not None]
    return {
        "steps": len(stats),
        "host_ms_median": 1e3 * statistics.median(s.host_s for s in stats),
        "device_ms_median": 1e3 * statistics.median(s.device_s for s in stats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--profile", choices=list(VARIANTS), help="cProfile this variant's run")
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="report each place a variant's steps synchronize with the device",
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    core = b2_engine(QWEN3_06B)
    prompts, _, _ = b2_workload()
    run(core, prompts[:4], [SamplingParams(max_tokens=8)] * 4)
    results = {}
    for name in args.variants:
        _, _, params = b2_workload(**VARIANTS[name])
        core.step_stats.clear()
        profiler = cProfile.Profile() if name == args.profile else None
        if profiler is not None:
            profiler.enable()
        with warnings.catch_warnings(record=True) as syncs:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if args.sync_debug else 0)
            seconds, tokens = run(core, prompts, params)
            torch.cuda.set_sync_debug_mode(0)
        if args.sync_debug:
            sites = collections.Counter(
                f"{w.filename}:{w.lineno}: {w.message}".splitlines()[0] for w in syncs
            )
            (args.out / f"syncs-{name}.txt").write_text(
                "\n".join(f"{n} x {site}" for site, n in sites.most_common())
            )
        if profiler is not None:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            (args.out / f"profile-{name}.txt").write_text(text.getvalue())
        results[name] = {"output_tokens_per_s": tokens / seconds, **step_figures(core)}
        print(name, json.dumps(results[name]))
    results["device"] = torch.cuda.get_device_name()
    (args.out / "sampling_cost.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
