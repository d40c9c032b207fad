"""What the API process spends per streamed token, per SSE event and per request, for one or two
packages side by side (issue 24's B4: at 256 streams on a fast GPU the API process is the bound).

Each package runs `met serve` on a tiny model (random weights: Qwen3's layout at hidden 64 with
the demo tokenizer, so the engine is cheap and every id decodes), started side by side and driven
in alternating rounds so drift hits both alike. A round streams `--streams` concurrent
`/v1/completions` of `--output-len` greedy tokens (EOS ignored) from a load process of raw
asyncio HTTP/1.1 connections (lighter than an HTTP library, so the API process gets its core).
Each round reads the API process's CPU (every thread, the scheduler's nanoseconds) and counts the
SSE events the clients received: with the coalescing of `AsyncLLM.generate` a server that falls
behind frames several tokens an event, so both per-token and per-event figures are reported. A
second kind of round sends one-token requests, whose CPU is mostly per-request work.

Where there are at least two CPUs, the API processes run on the last one and the engines and the
load process on the others.

    python bench/api_cost.py [--baseline bench/.baseline] [--streams 256 --output-len 256]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
sys.path.insert(0, str(ROOT))
from provenance import git_sha, metrale_tree  # noqa: E402
from serve_telemetry import (  # noqa: E402
    QWEN3_06B_BODY,
    _pin_tasks,
    _task_cpu_s,
    dummy_checkpoint,
    free_port,
    wait_healthy,
)

# Qwen3's layout at hidden 64, with the demo tokenizer's vocabulary: an engine that costs little.
TINY_QWEN3 = QWEN3_06B_BODY | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "torch_dtype": "float32",
}


def start(package: Path, model: Path, streams: int, extra: list[str], log: Path, cpus: set[int]):
    """`met serve` confined to `cpus` from its start, so its engine sizes its threads to them;
    its API process moves to a CPU of its own once it is up."""
    port = free_port()
    cmd = [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(model)]
    cmd += ["--port", str(port), "--load-format", "dummy", "--enforce-eager"]
    cmd += ["--no-prefix-caching", "--max-num-seqs", str(streams), "--max-seq-len", "2048"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(package), os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.Popen(
        [*cmd, *extra],
        cwd=package,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    return process, port


async def _stream_one(port: int, body: bytes, start: float) -> tuple[int, float]:
    """One streamed completion over a fresh connection: (SSE data events, seconds from `start`
    to its first event)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )
    received = b""
    first = None
    while chunk := await reader.read(65536):
        received += chunk
        if first is None and b"data: {" in received:
            first = time.perf_counter() - start
    writer.close()
    if not received.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(received[:300].decode(errors="replace"))
    return received.count(b"data: {"), first if first is not None else float("nan")


def drive(port: int, model: str, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt streamed at once (run in the load process)."""

    async def run() -> list[tuple[int, float]]:
        bodies = [
            json.dumps(
                {
                    "model": model,
                    "prompt": p,
                    "max_tokens": output_len,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                }
            ).encode()
            for p in prompts
        ]
        return await asyncio.gather(*(_stream_one(port, b, start) for b in bodies))

    start = time.perf_counter()
    results = asyncio.run(run())
    firsts = sorted(f for _, f in results)
    return {
        "seconds": time.perf_counter() - start,
        "events": sum(e for e, _ in results),
        "ttft_median_s": firsts[len(firsts) // 2],
        "ttft_max_s": firsts[-1],
    }


def _pin_load(cpus: set[int]) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def measure(pool, pid: int, port: int, model: str, prompts, output_len: int) -> dict:
    before = _task_cpu_s(pid)
    result = pool.apply(drive, (port, model, prompts, output_len))
    cpu = _task_cpu_s(pid) - before
    tokens = len(prompts) * output_len
    return {
        "tokens_per_s": tokens / result["seconds"],
        "events_per_token": result["events"] / tokens,
        "api_ms_per_1k_tokens": 1e6 * cpu / tokens,
        "api_us_per_event": 1e6 * cpu / result["events"],
        "api_ms_per_request": 1e3 * cpu / len(prompts),
        "api_busy": cpu / result["seconds"],
        "ttft_median_ms": 1e3 * result["ttft_median_s"],
        "ttft_max_ms": 1e3 * result["ttft_max_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a directory with another metrale/")
    parser.add_argument("--candidate", type=Path, default=REPO)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--serve-args", default="", help="more `met serve` flags, for both")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--label", default="")
    args = parser.parse_args()

    model = dummy_checkpoint(TINY_QWEN3)
    logs = Path(tempfile.mkdtemp(prefix="bench-api-cost-logs-"))
    packages = {"candidate": args.candidate.resolve()}
    if args.baseline:
        packages = {"baseline": args.baseline.resolve(), **packages}
    cpus = sorted(os.sched_getaffinity(0))
    api_cpus = {cpus[-1]} if len(cpus) > 1 else set(cpus)
    other_cpus = set(cpus[:-1]) if len(cpus) > 1 else set(cpus)
    servers = {
        name: start(
            pkg, model, args.streams, args.serve_args.split(), logs / f"{name}.log", other_cpus
        )
        for name, pkg in packages.items()
    }
    pool = multiprocessing.get_context("spawn").Pool(1, _pin_load, (other_cpus,))
    rng = random.Random(0)
    results: dict[str, dict[str, list[dict]]] = {n: {"stream": [], "requests": []} for n in servers}
    try:
        for name, (process, port) in servers.items():
            wait_healthy(process, f"http://127.0.0.1:{port}", logs / f"{name}.log")
            _pin_tasks(process.pid, api_cpus)
            pool.apply(drive, (port, str(model), [[5, 6, 7]] * 16, 16))  # warm up
        for i in range(args.rounds):
            prompts = [
                [rng.randrange(10, 4000) for _ in range(args.prompt_len)]
                for _ in range(args.streams)
            ]
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                process, port = servers[name]
                stream = measure(pool, process.pid, port, str(model), prompts, args.output_len)
                requests = measure(pool, process.pid, port, str(model), prompts, 1)
                results[name]["stream"].append(stream)
                results[name]["requests"].append(requests)
                print(
                    f"round {i} {name}: {stream['tokens_per_s']:.0f} tok/s, "
                    f"{stream['events_per_token']:.2f} events a token, API "
                    f"{stream['api_ms_per_1k_tokens']:.1f} ms per 1k tokens, "
                    f"{stream['api_us_per_event']:.1f} us an event, busy "
                    f"{stream['api_busy']:.0%}, TTFT median / max {stream['ttft_median_ms']:.0f} / "
                    f"{stream['ttft_max_ms']:.0f} ms; one-token requests: API "
                    f"{requests['api_ms_per_request']:.2f} ms a request",
                    flush=True,
                )
    finally:
        pool.terminate()
        for process, _ in servers.values():
            process.send_signal(signal.SIGTERM)
        for process, _ in servers.values():
            process.wait(60)
        shutil.rmtree(model, ignore_errors=True)

    def median(name: str, kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name][kind])

    summary = {
        name: {
            "api_ms_per_1k_tokens": median(name, "stream", "api_ms_per_1k_tokens"),
            "api_us_per_event": median(name, "stream", "api_us_per_event"),
            "events_per_token": median(name, "stream", "events_per_token"),
            "tokens_per_s": median(name, "stream", "tokens_per_s"),
            "api_ms_per_request": median(name, "requests", "api_ms_per_request"),
            "ttft_max_ms": median(name, "stream", "ttft_max_ms"),
        }
        for name in servers
    }
    for name, s in summary.items():
        print(f"{name} medians: " + ", ".join(f"{k} {v:.3g}" for k, v in s.items()))
    if "baseline" in summary:
        ratios = {k: summary["candidate"][k] / summary["baseline"][k] for k in summary["candidate"]}
        print("candidate / baseline: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        summary["ratio"] = ratios
    args.out.mkdir(parents=True, exist_ok=True)
    label = f"-{args.label}" if args.label else ""
    path = args.out / f"api_cost-{datetime.date.today().isoformat()}{label}.json"
    path.write_text(
        json.dumps(
            {
                "git": git_sha(),
                "metrale_tree": metrale_tree(),
                "packages": {n: str(p) for n, p in packages.items()},
                "cpus": {"api": sorted(api_cpus), "engine_and_load": sorted(other_cpus)},
                "args": {k: str(v) for k, v in vars(args).items()},
                "summary": summary,
                "rounds": results,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
