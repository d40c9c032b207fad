"""What every `met bench` command shares: the dataset flags, the tokenizer lengths are counted
with, and the provenance a result file carries (version, git SHA, host, arguments)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

from metrale.entrypoints.cli.bench.datasets import DATASETS, DatasetSpec, Sample


def add_dataset_arguments(parser: argparse.ArgumentParser, *, seed: bool = True) -> None:
    """The dataset flags; `seed=False` where the engine's `--seed` is already a flag."""
    g = parser.add_argument_group("dataset")
    g.add_argument(
        "--dataset",
        "--dataset-name",
        default="random",
        choices=DATASETS,
        help="where the prompts come from (default random)",
    )
    g.add_argument("--dataset-path", type=Path, help="sharegpt: a local ShareGPT-format JSON")
    g.add_argument("--num-prompts", type=int, default=100, help="requests per run")
    g.add_argument(
        "--input-len",
        type=int,
        default=1024,
        help="prompt tokens (random, sonnet; prefix: the part after the prefix)",
    )
    g.add_argument("--output-len", type=int, default=128, help="max tokens asked for")
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len*(1-r), len*(1+r)]",
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="random and prefix: shared prefix tokens; sonnet: fixed-line tokens",
    )
    g.add_argument(
        "--prefix-num-groups", type=int, default=4, help="prefix: distinct shared prefixes"
    )
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        help="sharegpt: this output length instead of each reply's",
    )
    g.add_argument(
        "--tokenizer",
        help="a directory, GGUF file or cached Hugging Face id to count tokens with "
        "(default: the served model, when it resolves here)",
    )
    if seed:
        g.add_argument("--seed", type=int, default=0, help="the dataset's and arrivals' seed")


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    prefix_len = args.prefix_len
    if args.dataset == "sonnet" and prefix_len == 0:
        prefix_len = 200  # vLLM's default for sonnet
    return DatasetSpec(
        name=args.dataset,
        num_prompts=args.num_prompts,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=prefix_len,
        num_groups=args.prefix_num_groups,
        path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len,
    )


def describe_dataset(spec: DatasetSpec, samples: list[Sample]) -> dict[str, Any]:
    lens = [s.prompt_len for s in samples]
    outs = [s.output_len for s in samples]
    return {
        **{k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(spec).items()},
        "num_samples": len(samples),
        "mean_prompt_len": statistics.fmean(lens),
        "mean_output_len": statistics.fmean(outs),
    }


def load_tokenizer(name: str | None, model: str | None = None, info: dict | None = None) -> Any:
    """The tokenizer lengths are counted with: `name` (a directory, GGUF file or cached id),
    else the checkpoint a Metrale server reports in /serve-config, else `model` when it
    resolves here."""
    from metrale.checkpoint.resolve import resolve_model_dir
    from metrale.tokenizer import Tokenizer

    candidates = [name] if name else []
    served = ((info or {}).get("serve-config") or {}).get("engine", {}).get("model_dir")
    if not name:
        candidates += [c for c in (served, model) if c]
    problems = []
    for candidate in candidates:
        try:
            return Tokenizer.from_dir(resolve_model_dir(candidate))
        except (OSError, ValueError) as e:
            problems.append(f"{candidate}: {e}")
    if name:
        raise ValueError(f"--tokenizer {problems[0]}")
    raise ValueError(
        "no tokenizer to count tokens with: pass --tokenizer DIR (the served checkpoint, its "
        "GGUF file or a cached Hugging Face id)" + "".join(f"; {p}" for p in problems)
    )


def metadata(command: str, args: argparse.Namespace) -> dict[str, Any]:
    """Where a result came from: the command and its arguments, Metrale's version and commit,
    the host and the date."""
    from metrale import __version__

    arguments = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in ("run", "api_key") and not callable(v)
    }
    if isinstance(arguments.get("compare"), list):
        arguments["compare"] = [str(p) for p in arguments["compare"]]
    return {
        "benchmark": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "metrale_version": __version__,
        "git_sha": git_sha(),
        "host": {
            "node": platform.node(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "arguments": arguments,
    }


def git_sha() -> str | None:
    """The commit of the Metrale checkout running, if it is one."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
