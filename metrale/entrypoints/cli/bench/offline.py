"""`met bench offline` and `met bench latency`: the engine in this process, no HTTP.

`offline` hands every sample to `LLM.generate` at once and reports requests/s and tokens/s, as
`vllm bench throughput` does; `latency` times batches of `--batch-size` prompts of random token
ids end to end, warm-up iterations first, as `vllm bench latency` does. Both force the output
length (`ignore_eos`) so every run does the same work, greedy unless `--temperature` (vLLM's
two sample at temperature 1); `--load-format dummy` runs any config.json on random weights.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from metrale.engine_args import EngineArgs
from metrale.entrypoints.cli.bench.datasets import sample_requests
from metrale.entrypoints.cli.bench.workload import (
    add_dataset_arguments,
    dataset_spec,
    describe_dataset,
    metadata,
)

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", help="a Hugging Face id or a directory (default: the demo model)"
    )
    parser.add_argument("--result-file", type=Path, help="write the results as JSON here")
    parser.add_argument("--no-warmup", action="store_true", help="offline: skip the warm-up")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's sampling temperature (default 0: greedy; vLLM's benches sample at 1)",
    )
    EngineArgs.add_cli_args(parser)


def add_offline_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    add_dataset_arguments(parser, seed=False)


def add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    g = parser.add_argument_group("latency")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per timed batch")
    g.add_argument("--num-iters-warmup", type=int, default=3, help="untimed batches first")
    g.add_argument("--num-iters", type=int, default=10, help="timed batches")


def run_offline(args: argparse.Namespace) -> int:
    from metrale import SamplingParams

    SamplingParams(temperature=args.temperature)  # a bad one refused before the engine loads
    llm = _engine(args)
    spec = dataset_spec(args)
    samples = sample_requests(spec, llm.get_tokenizer())
    params = [
        SamplingParams(max_tokens=s.output_len, temperature=args.temperature, ignore_eos=True)
        for s in samples
    ]
    if not args.no_warmup:
        llm.generate(samples[0].prompt, SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([s.prompt for s in samples], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(samples),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(samples) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "temperature": args.temperature,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    _write(args, "met bench offline", result | {"dataset": describe_dataset(spec, samples)})
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from metrale import SamplingParams

    if min(args.input_len, args.output_len, args.batch_size, args.num_iters) < 1:
        raise ValueError("--input-len, --output-len, --batch-size and --num-iters must be >= 1")
    params = SamplingParams(
        max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True
    )
    llm = _engine(args)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(args.seed)

    def one_batch() -> float:
        prompts = [
            [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)
        ]
        start = time.perf_counter()
        llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        one_batch()
    latencies = np.asarray([one_batch() for _ in range(args.num_iters)])
    result: dict[str, Any] = {
        "avg_latency": float(latencies.mean()),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in LATENCY_PERCENTILES},
        "output_tokens_per_second": args.batch_size * args.output_len / float(latencies.mean()),
        "temperature": args.temperature,
    }
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value:.4f} seconds")
    _write(args, "met bench latency", result)
    return 0


def _engine(args: argparse.Namespace) -> Any:
    from metrale import LLM

    engine_args = vars(EngineArgs.from_cli(args))
    return LLM(args.model, **{k: v for k, v in engine_args.items() if k != "model"})


def _write(args: argparse.Namespace, command: str, result: dict[str, Any]) -> None:
    if args.result_file is None:
        return
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps(metadata(command, args) | result, indent=1))
    print(f"wrote {args.result_file}")
