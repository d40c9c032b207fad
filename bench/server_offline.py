"""B4: what share of the offline engine's throughput `met serve` keeps, on the same requests.

`--streams` requests of `--prompt-len` random token ids and `--output-len` output tokens each
(greedy, EOS ignored), through a real `met serve` driven by that many concurrent streaming
`/v1/completions` requests (`serve_telemetry.py`'s load generators and CPU placement), and
through `LLM.generate` in a process of its own with the same engine flags, on the same GPU,
in alternating rounds (the two engines' KV pools are sized by `--num-kv-blocks`, so both fit).
Both are timed from the first request to the last token. Also the server's API and engine
processes' CPU time per thousand output tokens, and from the server's access log how the
round's requests arrived: the spread of the times the server began reading them, and their
TTFT as the server measured it. `--package DIR` serves another metrale/ (the offline reference
stays this checkout's). The model: random weights of Qwen3-0.6B's
shape (the demo tokenizer's vocabulary, so every id decodes), where the API process's share
of the work is the largest, or `--llama-8b`.

    python bench/server_offline.py [--streams 256 --prompt-len 128 --output-len 256 --rounds 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from gc_pauses import GcPauses  # noqa: E402
from gpu_suite import LLAMA_8B  # noqa: E402
from provenance import git_sha, metrale_tree  # noqa: E402
from serve_telemetry import (  # noqa: E402
    QWEN3_06B_BODY,
    Placement,
    dummy_checkpoint,
    load,
    start,
    wait_healthy,
)

REPO = ROOT.parent


def offline_worker(model: str, flags: dict, prompts: list[list[int]], output_len: int, pipe):
    """The offline engine, built once; each message on `pipe` runs every prompt once and
    answers (output tokens, seconds, seconds in the garbage collector, the device's seconds and
    the engine's steps)."""
    from metrale import LLM, SamplingParams

    llm = LLM(model, **flags)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:16], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    pauses = GcPauses()
    while pipe.recv():
        pauses.seconds = 0.0
        llm.engine.step_stats.clear()
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        steps = list(llm.engine.step_stats)
        device_s = sum(s.device_s or 0.0 for s in steps)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        pipe.send((tokens, seconds, pauses.seconds, device_s, len(steps)))


def device_steps(url: str) -> tuple[float, int]:
    """The server's engine steps so far: the device's seconds in them and their count (the
    `metrale:engine_step_seconds` histogram's sum and count for the device part)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = {
        sample.name.rsplit("_", 1)[1]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "metrale:engine_step_seconds"
        for sample in family.samples
        if sample.labels.get("part") == "device" and sample.name.endswith(("_sum", "_count"))
    }
    return found.get("sum", 0.0), int(found.get("count", 0))


_ACCESS = re.compile(
    r"^(\S+ \S+) .* POST /v1/completions 200 .* generated=(\d+) ttft=([\d.]+)s total=([\d.]+)s"
)


def arrivals(log: Path, skip_lines: int, output_len: int) -> tuple[dict[str, float], int]:
    """How the requests logged after line `skip_lines` of the server's log arrived (those that
    generated `output_len` tokens): ms from the first to the median and the last start (when
    the server began reading each), and the server's TTFT median and max. Also the log's line
    count, for the next round."""
    lines = log.read_text().splitlines()
    starts, ttfts = [], []
    for line in lines[skip_lines:]:
        match = _ACCESS.match(line)
        if match is None or int(match[2]) != output_len:
            continue
        end = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        starts.append(end - float(match[4]))
        ttfts.append(float(match[3]))
    if not starts:
        return {}, len(lines)
    starts.sort()
    ttfts.sort()
    return {
        "start_spread_median_ms": 1e3 * (starts[len(starts) // 2] - starts[0]),
        "start_spread_max_ms": 1e3 * (starts[-1] - starts[0]),
        "server_ttft_median_ms": 1e3 * ttfts[len(ttfts) // 2],
        "server_ttft_max_ms": 1e3 * ttfts[-1],
    }, len(lines)


def wait_serving(log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while "serving " not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8, help="load-generating processes")
    parser.add_argument("--num-kv-blocks", type=int, default=8192, help="each engine's pool")
    parser.add_argument("--llama-8b", action="store_true", help="Llama-3.1-8B's shape instead")
    parser.add_argument("--package", type=Path, default=REPO, help="the metrale/ to serve")
    parser.add_argument("--label", default="", help="appended to the results file's name")
    parser.add_argument(
        "--serve-args", default="", help="more `met serve` flags that the offline side lacks"
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "results")))
    args = parser.parse_args()

    model = dummy_checkpoint(LLAMA_8B if args.llama_8b else QWEN3_06B_BODY)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 4000) for _ in range(args.prompt_len)] for _ in range(args.streams)
    ]
    # The same engine flags on both sides (those `start` gives the server, too).
    flags = {
        "load_format": "dummy",
        "dtype": "bfloat16",
        "max_seq_len": 2048,
        "enable_prefix_caching": False,
        "max_num_seqs": args.streams,
        "num_kv_blocks": args.num_kv_blocks,
    }
    serve_flags = ["--max-num-seqs", str(args.streams), "--num-kv-blocks", str(args.num_kv_blocks)]
    serve_flags += args.serve_args.split()
    logs = Path(tempfile.mkdtemp(prefix="bench-b4-logs-"))
    api_processes = 1  # `--serve-args=--api-server-count=N`: a core for each
    for flag in ("--api-server-count=", "--api-server-count "):
        if flag in args.serve_args:
            api_processes = int(args.serve_args.split(flag)[1].split()[0])
    placement = Placement(True, 1, api_processes)
    if placement.enabled:
        os.sched_setaffinity(0, placement.clients(0))
    package = args.package.resolve()
    process, url = start(package, model, True, serve_flags, logs / "server.log", placement, 0)
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    offline = spawn.Process(
        target=offline_worker, args=(str(model), flags, prompts, args.output_len, theirs)
    )
    offline.start()
    pool = ProcessPoolExecutor(args.clients, mp_context=spawn, initializer=placement.pin_clients(0))
    rounds = []
    try:
        wait_healthy(process, url, logs / "server.log")
        wait_serving(logs / "server.log")  # every API process
        placement.pin_server(process.pid, 0)
        if placement.enabled:  # the offline engine on the server's CPUs
            slot = placement.slots[0]
            os.sched_setaffinity(offline.pid, slot.api | slot.engine)
        load(pool, url, prompts[:16], 16, events=False)  # warm up
        log_lines = 0
        for i in range(args.rounds):
            ours.send(True)
            tokens, seconds, gc_seconds, device_s, steps = ours.recv()
            before = device_steps(url)
            server = load(pool, url, prompts, args.output_len, False, process.pid)
            time.sleep(0.5)  # the last steps' figures and access log lines in
            after = device_steps(url)
            entry = {
                "offline_tokens_per_s": tokens / seconds,
                "offline_gc_ms": 1e3 * gc_seconds,  # of its seconds, in the collector
                "server_tokens_per_s": server["tokens_per_s"],
                "ratio": server["tokens_per_s"] / (tokens / seconds),
                "server_cpu_ms_per_1k_tokens": server["cpu_ms_per_1k_tokens"],
                "api_busy": server["api_busy"],
                # The device's time in the engine's steps (each from its launch on the stream
                # to its tokens' copy) over the round's wall time, and the steps: where the
                # server's round is longer, whether the device idled or had more to do.
                "offline_device_busy": device_s / seconds,
                "offline_steps": steps,
                "server_device_busy": (after[0] - before[0])
                * server["tokens_per_s"]
                / server["tokens"],
                "server_steps": after[1] - before[1],
            }
            spread, log_lines = arrivals(logs / "server.log", log_lines, args.output_len)
            entry["arrivals"] = spread
            rounds.append(entry)
            print(f"round {i}: {json.dumps(entry)}", flush=True)
        ours.send(False)
        forward = httpx.get(url + "/forward").json()
    finally:
        pool.shutdown(cancel_futures=True)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        offline.join(60)
        if offline.is_alive():
            offline.kill()

    import torch

    result = {
        "benchmark": "server_offline (B4)",
        "date": datetime.date.today().isoformat(),
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": "Llama-3.1-8B shape" if args.llama_8b else "Qwen3-0.6B shape",
        "workload": vars(args)
        | {"out": str(args.out), "package": str(package), "placement": placement.describe()},
        "forward": forward,
        "rounds": rounds,
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "median_server_tokens_per_s": statistics.median(r["server_tokens_per_s"] for r in rounds),
        "median_offline_tokens_per_s": statistics.median(r["offline_tokens_per_s"] for r in rounds),
        "median_api_cpu_ms_per_1k_tokens": statistics.median(
            r["server_cpu_ms_per_1k_tokens"]["api"] for r in rounds
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    label = f"-{args.label}" if args.label else ""
    out = args.out / f"server_offline-{result['date']}{label}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith("median")}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
