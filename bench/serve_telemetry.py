"""What the telemetry costs a busy server: `met serve` with its metrics and one `/v1/events`
subscriber reading every event, against the same server without telemetry, in one run.

"Without" is, by default, the same package started with `--disable-log-stats --no-access-log`
(no Prometheus series, no step timing in the engine, no access log lines) and no subscriber;
`--baseline DIR` runs an older package instead (a copy of `metrale/`, e.g. `git archive
9baa136 metrale | tar -x -C bench/.baseline`, from before telemetry landed). Both servers run
side by side on the same machine and are driven in alternating rounds, so drift hits both
alike. Workload: `--streams` concurrent streaming `/v1/completions` requests of `--prompt-len`
random token ids and `--output-len` output tokens each (greedy, EOS ignored), sent by
`--clients` processes; the subscriber reads in a process of its own.

Each round also records the CPU time of each server's API process and engine process (the
scheduler's per-thread nanoseconds, /proc) per thousand generated tokens: a quieter figure than
throughput on a shared machine, and the one that says which process the telemetry costs.
The model: a checkpoint directory, or `--dummy qwen3_0.6b` (random weights of Qwen3-0.6B's
shape with the demo tokenizer's 4096-token vocabulary, so every sampled id decodes).

    python bench/serve_telemetry.py [--baseline bench/.baseline] [--dummy qwen3_0.6b] \
        [--streams 256 --prompt-len 128 --output-len 256 --rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
sys.path.insert(0, str(ROOT))
from gpu_suite import QWEN3_06B  # noqa: E402
from serve_cpu import one_stream  # noqa: E402

# Qwen3-0.6B's body with the demo tokenizer's vocabulary, so every sampled id decodes.
QWEN3_06B_BODY = {**QWEN3_06B, "vocab_size": 4096, "eos_token_id": 2}


SAMPLED = tuple(
    "metrale:" + name
    for name in (
        "generation_tokens_total",
        "request_success_total",
        "engine_step_seconds_sum",
        "engine_step_seconds_count",
        "cuda_graph_replays_total",
        "events_dropped_total",
    )
)


def dummy_checkpoint() -> Path:
    path = Path(tempfile.mkdtemp(prefix="bench-telemetry-"))
    (path / "config.json").write_text(json.dumps(QWEN3_06B_BODY))
    for f in (REPO / "metrale" / "demo" / "tokenizer").iterdir():
        shutil.copy(f, path / f.name)
    return path


def _task_cpu_s(pid: int) -> float:
    """CPU time of every thread of `pid` (the scheduler's nanoseconds, not 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that just exited
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def server_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of a `met serve` process (`api`: its threads) and of its children
    (`engine`: the engine core process, with its torch threads). Linux only; {} elsewhere."""
    if not Path(f"/proc/{pid}/task").exists():
        return {}
    return {"api": _task_cpu_s(pid), "engine": sum(_task_cpu_s(c) for c in _children(pid))}


class Placement:
    """Which CPUs each side runs on. On a shared host the scheduler otherwise moves the API
    process (the bottleneck at hundreds of streams) onto a core whose other hardware thread is
    busy, and a round runs 30% slower for it: both servers' API processes get one physical core
    of their own, their engine processes two, and the load generators the rest. (The servers
    take turns, so they share their cores.) With fewer than five physical cores, nothing is
    pinned."""

    def __init__(self, enabled: bool) -> None:
        cores: dict[str, set[int]] = {}
        for cpu in sorted(os.sched_getaffinity(0)):
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
            key = siblings.read_text().strip() if siblings.exists() else str(cpu)
            cores.setdefault(key, set()).add(cpu)
        physical = list(cores.values())
        self.enabled = enabled and len(physical) >= 5
        self.api = physical[0] if self.enabled else set()
        self.engine = physical[1] | physical[2] if self.enabled else set()
        self.clients = set().union(*physical[3:]) if self.enabled else set()

    def describe(self) -> dict | None:
        if not self.enabled:
            return None
        return {k: sorted(getattr(self, k)) for k in ("api", "engine", "clients")}

    def server_start(self) -> None:
        """In the server before it execs: the API's and the engine's CPUs, so the engine's
        torch sizes its thread pool for what it will have."""
        if self.enabled:
            os.sched_setaffinity(0, self.api | self.engine)

    def pin_server(self, pid: int) -> None:
        """Once it is up: every thread of the API process to its core, of the engine to its."""
        if not self.enabled:
            return
        _pin_tasks(pid, self.api)
        for child in _children(pid):
            _pin_tasks(child, self.engine)

    def client(self) -> None:
        if self.enabled:
            os.sched_setaffinity(0, self.clients)


def _pin_tasks(pid: int, cpus: set[int]) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just exited
            os.sched_setaffinity(int(task.name), cpus)


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # the field after the state: the parent's pid
            children.append(int(stat.parent.name))
    return children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    package_dir: Path,
    model: Path,
    dummy: bool,
    extra: list[str],
    log: Path,
    placement: Placement,
    profile: Path | None = None,
):
    port = free_port()
    profiler = ["-m", "cProfile", "-o", str(profile)] if profile else []
    cmd = [sys.executable, *profiler, "-m", "metrale", "serve", "--model-from-path", str(model)]
    cmd += ["--port", str(port), "--max-seq-len", "2048", "--no-prefix-caching", *extra]
    if dummy:
        cmd += ["--load-format", "dummy", "--dtype", "bfloat16"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(package_dir), os.environ.get("PYTHONPATH")])
        ),
    }
    process = subprocess.Popen(
        cmd,
        cwd=package_dir,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        preexec_fn=placement.server_start,
    )
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")


async def _subscribe(url: str, counts: dict[str, int]) -> None:
    async with (
        httpx.AsyncClient(timeout=None) as client,
        client.stream("GET", url + "/v1/events") as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                kind = line[7:]
                counts[kind] = counts.get(kind, 0) + 1


def subscriber(url: str, stop, results, cpus: set[int]) -> None:
    """Read every event, as a dashboard would, in a process of its own (so the load generator's
    processes do the same work in both variants) until `stop` is set."""
    if cpus:
        os.sched_setaffinity(0, cpus)

    async def run() -> None:
        counts: dict[str, int] = {}
        task = asyncio.create_task(_subscribe(url, counts))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the last summaries
        task.cancel()
        results.put(counts)

    asyncio.run(run())


def client_worker(url: str, prompts: list[list[int]], output_len: int, start_at: float):
    """One load process: its share of the streams, started at `start_at` (wall clock)."""

    async def run() -> tuple[int, float, float, float]:
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            begin, cpu = time.time(), time.process_time()
            tokens = await asyncio.gather(*(one_stream(client, p, output_len) for p in prompts))
            return sum(tokens), begin, time.time(), time.process_time() - cpu

    return asyncio.run(run())


def load(
    pool,
    url: str,
    prompts: list[list[int]],
    output_len: int,
    events: bool,
    pid: int = 0,
    client_cpus: set[int] | None = None,
) -> dict:
    """One round: every prompt streamed once. Besides the throughput, what each side spent:
    CPU milliseconds per thousand generated tokens of the server's API and engine processes
    and of the load generators, and how busy the API process was (CPU / wall)."""
    context = multiprocessing.get_context("spawn")
    reader = None
    if events:
        stop, results = context.Event(), context.Queue()
        reader = context.Process(target=subscriber, args=(url, stop, results, client_cpus or set()))
        reader.start()
        time.sleep(1.0)  # connected and replaying the startup phases
    shares = [prompts[i :: pool._max_workers] for i in range(pool._max_workers)]
    start_at = time.time() + 0.5
    cpu_before = server_cpu_s(pid) if pid else {}
    done = [
        f.result()
        for f in [pool.submit(client_worker, url, s, output_len, start_at) for s in shares if s]
    ]
    tokens = sum(d[0] for d in done)
    elapsed = max(d[2] for d in done) - min(d[1] for d in done)
    cpu_after = server_cpu_s(pid) if pid else {}
    wall = time.time() - start_at
    cpu_ms = {k: 1e6 * (cpu_after[k] - cpu_before[k]) / tokens for k in cpu_after}
    cpu_ms["clients"] = 1e6 * sum(d[3] for d in done) / tokens
    counts = {}
    if reader is not None:
        stop.set()
        counts = results.get(timeout=30)
        reader.join(30)
    return {
        "tokens_per_s": tokens / elapsed,
        "tokens": tokens,
        "cpu_ms_per_1k_tokens": cpu_ms,
        "api_busy": (cpu_after["api"] - cpu_before["api"]) / wall if cpu_after else None,
        "events": counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a directory with an older metrale/ to compare against (default: this package "
        "with --disable-log-stats --no-access-log)",
    )
    parser.add_argument("--model", type=Path, help="a checkpoint directory")
    parser.add_argument(
        "--candidate",
        type=Path,
        default=REPO,
        help="the directory with the metrale/ to measure (default: this checkout); the "
        "baseline's own directory gives an A/A run, which shows the bench's bias between slots",
    )
    parser.add_argument("--dummy", choices=["qwen3_0.6b"], help="random weights of this shape")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4, help="load-generating processes")
    parser.add_argument(
        "--profile-api",
        action="store_true",
        help="run the telemetry server's API process under cProfile (to --out)",
    )
    parser.add_argument(
        "--no-subscriber", action="store_true", help="metrics only: no /v1/events reader"
    )
    parser.add_argument("--serve-args", default="", help="more `met serve` flags, for both")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument(
        "--no-pin", action="store_true", help="leave every process where the scheduler puts it"
    )
    parser.add_argument("--label", default="", help="appended to the results file's name")
    args = parser.parse_args()
    model = args.model.resolve() if args.model else dummy_checkpoint()
    extra = args.serve_args.split()
    import random

    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 4000) for _ in range(args.prompt_len)] for _ in range(args.streams)
    ]
    logs = Path(tempfile.mkdtemp(prefix="bench-telemetry-logs-"))
    placement = Placement(not args.no_pin)
    placement.client()  # this process too: it spawns the load generators
    quiet = [] if args.baseline else ["--disable-log-stats", "--no-access-log"]
    servers = {
        "baseline": start(
            (args.baseline or args.candidate).resolve(),
            model,
            args.dummy is not None,
            extra + quiet,
            logs / "baseline.log",
            placement,
        ),
        "telemetry": start(
            args.candidate.resolve(),
            model,
            args.dummy is not None,
            extra,
            logs / "telemetry.log",
            placement,
            args.out / "telemetry-api.prof" if args.profile_api else None,
        ),
    }
    try:
        pool = ProcessPoolExecutor(
            args.clients,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=placement.client,
        )
        for name, (process, url) in servers.items():
            wait_healthy(process, url, logs / f"{name}.log")
            placement.pin_server(process.pid)
            load(pool, url, prompts[:16], 16, events=False)  # warm up
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for i in range(args.rounds):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                process, url = servers[name]
                events = name == "telemetry" and not args.no_subscriber
                result = load(
                    pool, url, prompts, args.output_len, events, process.pid, placement.clients
                )
                runs[name].append(result)
                cpu = " ".join(f"{k} {v:.1f}" for k, v in result["cpu_ms_per_1k_tokens"].items())
                print(
                    f"round {i} {name}: {result['tokens_per_s']:.0f} tok/s; CPU ms per 1k "
                    f"tokens: {cpu}; API busy {result['api_busy'] or 0:.0%}",
                    flush=True,
                )
        metrics = httpx.get(servers["telemetry"][1] + "/metrics").text
        forward = httpx.get(servers["telemetry"][1] + "/forward").json()
    finally:
        for process, _ in servers.values():
            process.send_signal(signal.SIGTERM)
        for process, _ in servers.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    medians = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    cpu_medians = {
        name: {
            part: statistics.median(r["cpu_ms_per_1k_tokens"][part] for r in rs)
            for part in rs[0]["cpu_ms_per_1k_tokens"]
        }
        for name, rs in runs.items()
    }
    result = {
        "benchmark": "serve_telemetry",
        "date": datetime.date.today().isoformat(),
        "git_sha": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
        "workload": {
            "streams": args.streams,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "client_processes": args.clients,
            "cpus": placement.describe(),
            "events_subscriber": not args.no_subscriber,
            "model": args.dummy or str(args.model),
            "serve_args": extra,
            "candidate": str(args.candidate),
            "baseline": str(args.baseline or "the candidate, " + " ".join(quiet)),
        },
        "forward": forward,
        "runs": runs,
        "median_tokens_per_s": medians,
        "telemetry_vs_baseline": medians["telemetry"] / medians["baseline"],
        "median_cpu_ms_per_1k_tokens": cpu_medians,
        "cpu_telemetry_vs_baseline": {
            part: cpu_medians["telemetry"][part] / cpu_medians["baseline"][part]
            for part in cpu_medians["baseline"]
        },
        "metrics_sample": [line for line in metrics.splitlines() if line.startswith(SAMPLED)],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = ("-no-subscriber" if args.no_subscriber else "") + (
        f"-{args.label}" if args.label else ""
    )
    path = args.out / f"serve_telemetry{suffix}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    summary = {"median": medians, "ratio": result["telemetry_vs_baseline"]}
    summary["cpu_ratio"] = result["cpu_telemetry_vs_baseline"]
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
