"""S1: `met serve` to ready, and the first request after it, on random weights of a real shape.

Each round starts `met serve` on the Llama-3.1-8B shape (dummy bf16 weights, the demo
tokenizer; CUDA graphs on, the server's defaults otherwise), polls `/health` every 20 ms from
the moment the process is spawned, and times:

- ready: spawn to the first 200 from `/health`;
- each startup phase the server logs (`[ n/10] name  seconds`), and inside the engine its
  weights, KV sizing and runner (KV pool, CUDA graphs) seconds, and the graph capture;
- the first request's and the second request's time to first token (one streamed token of a
  128-token prompt): what a lazy startup would move onto the first request.

The first round runs with an empty Triton cache (`TRITON_CACHE_DIR` in a fresh directory: a new
machine's first start), the later rounds with the cache it left (every later start).

    python bench/startup.py [--rounds 3] [--serve-args "..."] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from gpu_suite import LLAMA_8B  # noqa: E402
from provenance import git_sha, metrale_tree  # noqa: E402
from serve_telemetry import dummy_checkpoint, free_port, wait_healthy  # noqa: E402

PHASE = re.compile(r"\[\s*(\d+)/\d+\] (.+?)\s+([\d.]+) s$", re.M)
ENGINE = re.compile(
    r"engine ready in ([\d.]+) s \(weights ([\d.]+) s, KV sizing ([\d.]+) s, runner ([\d.]+) s\)"
)
GRAPHS = re.compile(r"captured \d+ decode CUDA graphs .* in ([\d.]+) s")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)


def stamp(line_start: str) -> float:
    return datetime.datetime.strptime(line_start, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_token_s(url: str) -> float:
    """Seconds to the first streamed token of a 128-token prompt."""
    body = {
        "model": "m",
        "prompt": list(range(1000, 1128)),
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no token came")


def one_start(model: Path, triton_cache: Path, extra: list[str], log: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(model)]
    cmd += ["--served-model-name", "m", "--port", str(port), "--load-format", "dummy"]
    cmd += ["--dtype", "bfloat16", *extra]
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache)}
    url = f"http://127.0.0.1:{port}"
    start, spawned = time.perf_counter(), time.time()
    process = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(process, url, log, poll_s=0.02)
        ready = time.perf_counter() - start
        first, second = first_token_s(url), first_token_s(url)
    finally:
        process.terminate()
        process.wait(60)
    text = log.read_text()
    result: dict = {"ready_s": ready, "first_ttft_s": first, "second_ttft_s": second}
    result["phases_s"] = {m[2]: float(m[3]) for m in PHASE.finditer(text.replace("\r", "\n"))}
    if m := ENGINE.search(text):
        keys = ("engine_s", "weights_s", "kv_sizing_s", "runner_s")
        result["engine"] = dict(zip(keys, map(float, m.groups()), strict=True))
    if m := GRAPHS.search(text):
        result["graph_capture_s"] = float(m[1])
    # Before the first log line: the interpreter, imports, the argument parsing. Between the
    # engine process's launch (its log line; a tree from before it had one launched it after
    # the fifth phase) and the engine's ready line, less the engine's own seconds: the engine
    # process's start (its interpreter, imports, config, the device's context).
    if m := STAMP.search(text):
        result["to_first_log_s"] = stamp(m[1]) - spawned
    lines = text.splitlines()
    engine_line = next((line for line in lines if "engine ready in" in line), None)
    launch = next((line for line in lines if "engine core process" in line), None)
    launch = launch or next((line for line in lines if "[ 5/" in line), None)
    if engine_line and launch and "engine" in result:
        result["engine_launched_s"] = stamp(launch[:23]) - spawned
        between = stamp(engine_line[:23]) - stamp(launch[:23])
        result["engine_process_start_s"] = between - result["engine"]["engine_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="the first with a cold Triton cache")
    parser.add_argument("--serve-args", default="", help="more `met serve` flags")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "results")))
    args = parser.parse_args()
    model = dummy_checkpoint(LLAMA_8B)
    cache = Path(tempfile.mkdtemp(prefix="bench-triton-"))
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        entry = one_start(model, cache, args.serve_args.split(), args.out / f"startup-{r}.log")
        entry["triton_cache"] = "cold" if r == 0 else "warm"
        rounds.append(entry)
        print(json.dumps(entry))
    import torch

    results = {
        "date": datetime.date.today().isoformat(),
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "tree": os.environ.get("TREE", "this checkout"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": "Llama-3.1-8B shape, dummy bf16 weights",
        "serve_args": args.serve_args,
        "rounds": rounds,
    }
    out = args.out / f"startup-{results['date']}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
