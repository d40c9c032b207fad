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
import functools
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
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
sys.path.insert(0, str(ROOT))
from gpu_suite import QWEN3_06B  # noqa: E402
from provenance import git_sha, metrale_tree  # noqa: E402
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


def dummy_checkpoint(config: dict = QWEN3_06B_BODY) -> Path:
    """A directory of `config` beside the demo tokenizer's files, for `--load-format dummy`."""
    path = Path(tempfile.mkdtemp(prefix="bench-dummy-"))
    (path / "config.json").write_text(json.dumps(config))
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
    """CPU seconds so far of a `met serve` process and its children: `api` its API processes'
    (`--api-server-count`), `engine` the engine core process's (with its torch threads and
    tensor-parallel ranks). Linux only; {} elsewhere."""
    if not Path(f"/proc/{pid}/task").exists():
        return {}
    api, engine = server_processes(pid)
    return {
        "api": sum(_task_cpu_s(p) for p in api),
        "engine": sum(_task_cpu_s(p) + sum(_task_cpu_s(c) for c in _children(p)) for p in engine),
    }


def server_processes(pid: int) -> tuple[list[int], list[int]]:
    """A `met serve` process's API processes (itself first) and its engine processes: the
    children it logged as API processes (their parent's command line) are API, the others
    engines. (multiprocessing's resource tracker, a child too, is neither.)"""
    api, engine = [pid], []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" in cmdline:
            continue
        (api if _is_api_process(child) else engine).append(child)
    return api, engine


def _is_api_process(pid: int) -> bool:
    """An API process past the first serves HTTP: it holds a listening TCP socket."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    listening.add(fields[9])
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:[") and target[8:-1] in listening:
                return True
    return False


@dataclass(frozen=True)
class Slot:
    """The CPUs one server and its load generators run on."""

    api: frozenset[int]
    engine: frozenset[int]
    clients: frozenset[int]

    def describe(self) -> dict[str, list[int]]:
        return {
            "api": sorted(self.api),
            "engine": sorted(self.engine),
            "clients": sorted(self.clients),
        }


class Placement:
    """Which CPUs each side runs on. On a shared host the scheduler otherwise moves the API
    process (the bottleneck at hundreds of streams) onto a core whose neighbours are busy: a
    server's API process gets a physical core of its own, its engine process two, its load
    generators a share of the rest. Servers that take turns share one slot; servers driven at
    once (`--concurrent`) get one each, swapped between rounds. With too few cores, nothing is
    pinned."""

    def __init__(self, enabled: bool, slots: int, api_cores: int = 1) -> None:
        cores: dict[str, set[int]] = {}
        for cpu in sorted(os.sched_getaffinity(0)):
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
            key = siblings.read_text().strip() if siblings.exists() else str(cpu)
            cores.setdefault(key, set()).add(cpu)
        physical = [frozenset(c) for c in cores.values()]
        # `api_cores`: a physical core for each API process (`--api-server-count`)
        taken = (api_cores + 2) * slots
        self.enabled = enabled and len(physical) >= taken + 2 * slots
        self.slots: list[Slot] = []
        if self.enabled:
            rest = physical[taken:]
            for k in range(slots):
                engine = api_cores * slots + 2 * k
                self.slots.append(
                    Slot(
                        api=frozenset().union(*physical[api_cores * k : api_cores * (k + 1)]),
                        engine=physical[engine] | physical[engine + 1],
                        clients=frozenset().union(*rest[k::slots]),
                    )
                )

    def describe(self) -> list[dict] | None:
        return [slot.describe() for slot in self.slots] if self.enabled else None

    def server_start(self, slot: int) -> Callable[[], None] | None:
        """For `Popen(preexec_fn=)`: the server starts on its API's and engine's CPUs, so the
        engine's torch sizes its thread pool for what it will have."""
        if not self.enabled:
            return None
        cpus = self.slots[slot].api | self.slots[slot].engine
        return functools.partial(os.sched_setaffinity, 0, cpus)

    def pin_server(self, pid: int, slot: int) -> None:
        """Every thread of the API processes to their cores, of the engine to its (again each
        round, when slots swap)."""
        if not self.enabled:
            return
        api, engine = server_processes(pid)
        for process in api:
            _pin_tasks(process, self.slots[slot].api)
        for process in engine:
            _pin_tasks(process, self.slots[slot].engine)

    def clients(self, slot: int) -> frozenset[int]:
        return self.slots[slot].clients if self.enabled else frozenset()

    def pin_clients(self, slot: int) -> Callable[[], None] | None:
        """For a process pool's `initializer`: its workers on the slot's client CPUs."""
        if not self.enabled:
            return None
        return functools.partial(os.sched_setaffinity, 0, self.slots[slot].clients)


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
    slot: int,
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
        preexec_fn=placement.server_start(slot),
    )
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(
    process: subprocess.Popen, url: str, log: Path, poll_s: float = 0.5, limit_s: float = 600
) -> None:
    """Until `/health` answers 200, asking every `poll_s`; a server that exits or takes over
    `limit_s` is a RuntimeError with its log's end."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
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
    client_cpus: frozenset[int] = frozenset(),
    start_at: float | None = None,
) -> dict:
    """One round: every prompt streamed once. Besides the throughput, what each side spent:
    CPU milliseconds per thousand generated tokens of the server's API and engine processes
    and of the load generators, and how busy the API process was (CPU / wall)."""
    context = multiprocessing.get_context("spawn")
    reader = None
    if events:
        stop, results = context.Event(), context.Queue()
        reader = context.Process(target=subscriber, args=(url, stop, results, set(client_cpus)))
        reader.start()
        time.sleep(1.0)  # connected and replaying the startup phases
    shares = [prompts[i :: pool._max_workers] for i in range(pool._max_workers)]
    start_at = start_at or time.time() + 0.5
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
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="drive both servers at once, each on CPUs of its own (swapped every other round), "
        "so the host's drift falls on both alike; otherwise they take turns",
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
    num_slots = 2 if args.concurrent else 1
    placement = Placement(not args.no_pin, num_slots)
    if placement.enabled:  # this process too: it spawns the load generators
        os.sched_setaffinity(0, frozenset().union(*(s.clients for s in placement.slots)))
    quiet = [] if args.baseline else ["--disable-log-stats", "--no-access-log"]
    servers = {
        "baseline": start(
            (args.baseline or args.candidate).resolve(),
            model,
            args.dummy is not None,
            extra + quiet,
            logs / "baseline.log",
            placement,
            0,
        ),
        "telemetry": start(
            args.candidate.resolve(),
            model,
            args.dummy is not None,
            extra,
            logs / "telemetry.log",
            placement,
            num_slots - 1,
            args.out / "telemetry-api.prof" if args.profile_api else None,
        ),
    }
    spawn = multiprocessing.get_context("spawn")
    pools = [
        ProcessPoolExecutor(args.clients, mp_context=spawn, initializer=placement.pin_clients(k))
        for k in range(num_slots)
    ]

    def drive(name: str, slot: int, start_at: float | None = None) -> dict:
        process, url = servers[name]
        events = name == "telemetry" and not args.no_subscriber
        result = load(
            pools[slot],
            url,
            prompts,
            args.output_len,
            events,
            process.pid,
            placement.clients(slot),
            start_at,
        )
        cpu = " ".join(f"{k} {v:.1f}" for k, v in result["cpu_ms_per_1k_tokens"].items())
        print(
            f"round {i} {name} (slot {slot}): {result['tokens_per_s']:.0f} tok/s; CPU ms per "
            f"1k tokens: {cpu}; API busy {result['api_busy'] or 0:.0%}",
            flush=True,
        )
        return result

    try:
        for slot, (name, (process, url)) in enumerate(servers.items()):
            wait_healthy(process, url, logs / f"{name}.log")
            slot = min(slot, num_slots - 1)
            placement.pin_server(process.pid, slot)
            load(pools[slot], url, prompts[:16], 16, events=False)  # warm up
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for i in range(args.rounds):
            if args.concurrent:  # both at once, in swapped slots every other round
                slots = {"baseline": i % 2, "telemetry": 1 - i % 2}
                for name, slot in slots.items():
                    placement.pin_server(servers[name][0].pid, slot)
                start_at = time.time() + 2.0  # after the subscriber has connected
                with ThreadPoolExecutor(2) as both:
                    futures = {n: both.submit(drive, n, k, start_at) for n, k in slots.items()}
                for name, future in futures.items():
                    runs[name].append(future.result())
            else:
                order = list(servers) if i % 2 == 0 else list(reversed(servers))
                for name in order:
                    runs[name].append(drive(name, 0))
        metrics = httpx.get(servers["telemetry"][1] + "/metrics").text
        forward = httpx.get(servers["telemetry"][1] + "/forward").json()
    finally:
        for pool in pools:
            pool.shutdown(cancel_futures=True)
        for process, _ in servers.values():
            process.send_signal(signal.SIGTERM)
        for process, _ in servers.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    # Each round's two runs met the same drift (at once, or one after the other).
    paired = [
        t["tokens_per_s"] / b["tokens_per_s"]
        for t, b in zip(runs["telemetry"], runs["baseline"], strict=True)
    ]
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
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "workload": {
            "streams": args.streams,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "client_processes": args.clients,
            "cpus": placement.describe(),
            "concurrent": args.concurrent,
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
        "paired_ratios": paired,
        "median_paired_ratio": statistics.median(paired),
        "geometric_mean_paired_ratio": statistics.geometric_mean(paired),
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
    summary["median_paired_ratio"] = result["median_paired_ratio"]
    summary["cpu_ratio"] = result["cpu_telemetry_vs_baseline"]
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
