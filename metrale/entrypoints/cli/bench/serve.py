"""`met bench serve`: drive OpenAI- or Anthropic-compatible servers with a dataset and report
`vllm bench serve`'s metrics, one run per request rate and concurrency asked for, per server.

    met bench serve --base-url http://127.0.0.1:8000 --dataset random --input-len 128 \\
        --output-len 128 --num-prompts 64 --max-concurrency 1,4,16 --result-file run.json

Several `--base-url NAME=URL` run one after another on the same prompts; `--plot DIR` draws
them side by side. On a server that exports vLLM's latency histograms (Metrale, vLLM) each run
also reports the server's own mean TTFT, TPOT, ITL and E2EL over the run, beside the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from metrale.entrypoints.cli.bench import report
from metrale.entrypoints.cli.bench.datasets import Sample, sample_requests
from metrale.entrypoints.cli.bench.endpoints import ENDPOINTS, RequestSettings, send
from metrale.entrypoints.cli.bench.load import ARRIVALS, LoadShape, run_load
from metrale.entrypoints.cli.bench.metrics import output_len, parse_goodput, summarize
from metrale.entrypoints.cli.bench.target import (
    Target,
    scrape,
    served_models,
    server_info,
    server_means,
)
from metrale.entrypoints.cli.bench.workload import (
    add_dataset_arguments,
    dataset_spec,
    describe_dataset,
    load_tokenizer,
    metadata,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target")
    g.add_argument(
        "--base-url",
        action="append",
        metavar="[NAME=]URL",
        help="a server to drive (repeat for several, run in turn on the same prompts; "
        "default http://127.0.0.1:8000)",
    )
    g.add_argument(
        "--endpoint", default="/v1/completions", choices=ENDPOINTS, help="the route to stream from"
    )
    g.add_argument("--model", help="the model name to send (default: the server's first)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a bearer token and x-api-key (default: $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--extra-body",
        type=json.loads,
        metavar="JSON",
        default=None,
        help="merged into every request body, e.g. '{\"min_tokens\": 128}'",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask for exactly the output length (vLLM's and Metrale's ignore_eos)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature sent (default 0: greedy)",
    )
    add_dataset_arguments(parser)
    g = parser.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        default="inf",
        metavar="RATE[,RATE...]",
        help="requests per second, or inf to send all at once; a list sweeps",
    )
    g.add_argument(
        "--max-concurrency",
        default=None,
        metavar="N[,N...]",
        help="at most N requests in flight; a list sweeps (default: no cap)",
    )
    g.add_argument(
        "--arrival",
        default="poisson",
        choices=ARRIVALS,
        help="gaps between sends at a finite rate: gamma-distributed, or all 1/rate",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="the gamma shape of the gaps between arrivals (1: Poisson)",
    )
    g.add_argument(
        "--deadline",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="each run ends by then; requests still running fail (default 600)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="one request's read timeout (default 300)",
    )
    g.add_argument(
        "--distinct-prompts",
        action="store_true",
        help="each run of a sweep draws its own prompts (seed + the run's index), so the "
        "server's prefix cache does not serve a run from an earlier run's prompts",
    )
    g.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the one request each server gets first (it also checks the route)",
    )
    g = parser.add_argument_group("results")
    g.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        default=None,
        help="SLOs for goodput, e.g. ttft:200 tpot:50 (ttft, tpot, e2el)",
    )
    g.add_argument("--percentiles", default="90,99", help="latency percentiles to report")
    g.add_argument("--result-file", type=Path, help="write the results as JSON here")
    g.add_argument("--plot", type=Path, metavar="DIR", help="write figures (PNG) into DIR")
    g.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="draw and tabulate earlier results side by side (no run)",
    )
    g.add_argument("--disable-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="keep every request's ITLs and generated text in the JSON",
    )


def run(args: argparse.Namespace) -> int:
    if args.compare:
        docs = [json.loads(Path(p).read_text()) for p in args.compare]
        print(report.comparison_table(docs))
        if args.plot:
            for path in report.plot(docs, args.plot):
                print(f"wrote {path}")
        return 0
    doc = asyncio.run(bench(args))
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.result_file}")
    if args.plot:
        for path in report.plot([doc], args.plot):
            print(f"wrote {path}")
    return 0 if all(r["completed"] for t in doc["targets"] for r in t["runs"]) else 1


def parse_sweep(text: str | None, *, kind: type, name: str) -> list[Any]:
    """`"1,4,inf"` as [1.0, 4.0, inf] (kind float) or `"1,4"` as [1, 4] (kind int)."""
    if text is None:
        return [None]
    try:
        values = [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} {text!r}: give a number or a comma-separated list") from None
    if not values:
        raise ValueError(f"{name} {text!r}: give at least one value")
    return values


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    targets = [Target.parse(s) for s in args.base_url or ["http://127.0.0.1:8000"]]
    if len({t.name for t in targets}) < len(targets):
        raise ValueError("--base-url: two targets share a name: name them NAME=URL")
    rates = parse_sweep(args.request_rate, kind=float, name="--request-rate")
    caps = parse_sweep(args.max_concurrency, kind=int, name="--max-concurrency")
    percentiles = parse_sweep(args.percentiles, kind=float, name="--percentiles")
    goodput = parse_goodput(args.goodput or [])
    shapes = [
        LoadShape(rate, cap, args.arrival, args.burstiness, args.deadline, args.seed)
        for rate in rates
        for cap in caps
    ]
    for shape in shapes:
        shape.check()
    spec = dataset_spec(args)
    samples: list[list[Sample]] | None = None  # per run of the sweep
    tokenizer = None
    doc: dict[str, Any] = metadata("met bench serve", args) | {"targets": []}
    for target in targets:
        async with _client(target, args) as client:
            info = await server_info(client)
            model = args.model or await _first_model(client, target)
            if samples is None:
                tokenizer = load_tokenizer(args.tokenizer, model, info)
                samples = [sample_requests(spec, tokenizer)]
                if args.distinct_prompts:
                    samples += [
                        sample_requests(dataclasses.replace(spec, seed=spec.seed + i), tokenizer)
                        for i in range(1, len(shapes))
                    ]
                doc["dataset"] = describe_dataset(spec, samples[0])
            settings = RequestSettings(model, args.ignore_eos, args.temperature, args.extra_body)
            if not args.no_warmup:
                await _warm_up(client, target, args.endpoint, samples[0][0], settings)
            entry = {
                "name": target.name,
                "base_url": target.base_url,
                "model": model,
                "server": info,
                "runs": [],
            }
            for i, shape in enumerate(shapes):
                print(f"\n{target.name}: {_describe(shape)}", file=sys.stderr)
                run_samples = samples[i if args.distinct_prompts else 0]
                row = await _one_run(
                    client, args, run_samples, settings, shape, goodput, percentiles, tokenizer
                )
                print(report.summary_table(row, percentiles))
                entry["runs"].append(row)
            doc["targets"].append(entry)
    return doc


async def _one_run(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    samples: list[Sample],
    settings: RequestSettings,
    shape: LoadShape,
    goodput: dict[str, float],
    percentiles: list[float],
    tokenizer: Any,
) -> dict[str, Any]:
    before = await scrape(client)
    with report.progress(len(samples), disabled=args.disable_progress) as advance:
        results, duration = await run_load(
            samples,
            lambda s: send(client, args.endpoint, s, settings),
            shape,
            on_done=lambda _: advance(),
        )
    after = await scrape(client)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    row: dict[str, Any] = {
        "request_rate": shape.request_rate if math.isfinite(shape.request_rate) else "inf",
        "max_concurrency": shape.max_concurrency,
        "num_prompts": len(samples),
        **summarize(
            results, duration, goodput=goodput, percentiles=percentiles, count_tokens=count_tokens
        ),
        **server_means(before, after),
        "goodput_slos_ms": goodput or None,
        "errors": dict(Counter(r.error.split(":")[0] for r in results if not r.success)),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [output_len(r, count_tokens) if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else None for r in results],
        "e2els": [r.latency if r.success else None for r in results],
    }
    if args.save_detailed:
        row["itls"] = [r.itl for r in results]
        row["generated_texts"] = [r.generated_text for r in results]
        row["error_messages"] = [r.error for r in results]
    return row


def _client(target: Target, args: argparse.Namespace) -> httpx.AsyncClient:
    headers = {"anthropic-version": "2023-06-01"}
    if args.api_key:
        headers |= {"Authorization": f"Bearer {args.api_key}", "x-api-key": args.api_key}
    return httpx.AsyncClient(
        base_url=target.base_url,
        headers=headers,
        timeout=httpx.Timeout(args.request_timeout, connect=10),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def _first_model(client: httpx.AsyncClient, target: Target) -> str:
    try:
        models = await served_models(client)
    except (httpx.HTTPError, ValueError) as e:
        problem = f"{target.base_url}/v1/models: {e}: is the server up? (or pass --model)"
        raise ValueError(problem) from None
    if not models:
        raise ValueError(f"{target.base_url}/v1/models lists no model: pass --model")
    return models[0]


async def _warm_up(
    client: httpx.AsyncClient,
    target: Target,
    endpoint: str,
    sample: Sample,
    settings: RequestSettings,
) -> None:
    result = await send(client, endpoint, sample, settings)
    if not result.success:
        raise ValueError(f"{target.base_url}{endpoint}: the first request failed: {result.error}")


def _describe(shape: LoadShape) -> str:
    rate = "inf" if math.isinf(shape.request_rate) else f"{shape.request_rate:g}/s"
    cap = shape.max_concurrency or "no cap"
    return f"request rate {rate}, max concurrency {cap}"
