"""Server throughput at 32 concurrent streams, against the offline engine in the same run.

The same ~58M-parameter Llama-shaped checkpoint as offline_cpu.py. Workload: 32 requests,
prompts of 128 random token ids, 128 output tokens each (greedy, EOS ignored). The server is a
real `met serve` subprocess (engine core in its own process) driven by 32 concurrent streaming
`/v1/completions` requests; the reference is `LLM.generate` on the same 32 requests in this
process, before the server starts. Output tokens/s are medians over --repeats runs.

With --security, the server is also measured with an API key and both rate limits on (limits
far above the workload, so every request is charged and none refused), in alternating rounds
against the plain server, and the ratio of the two medians is reported.

    python bench/serve_cpu.py [--repeats 3] [--security]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from metrale import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from offline_cpu import build_checkpoint  # noqa: E402
from provenance import git_sha, metrale_tree  # noqa: E402

NUM_STREAMS, PROMPT_LEN, OUTPUT_LEN = 32, 128, 128


def workload() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(10, 4000, (PROMPT_LEN,), generator=g).tolist() for _ in range(NUM_STREAMS)
    ]


def offline_tokens_per_s(path: Path, prompts: list[list[int]], repeats: int) -> list[float]:
    # No prefix caching on either side: every run computes its prompts.
    llm = LLM(
        model_from_path=str(path), dtype="float32", max_seq_len=1024, enable_prefix_caching=False
    )
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        runs.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    return runs


BENCH_KEY = "sk-bench"
# Limits no run comes near: the buckets are charged and refunded, never empty.
SECURITY_ENV = {
    "METRALE_API_KEY": BENCH_KEY,
    "METRALE_RATE_LIMIT_RPM": "1000000",
    "METRALE_RATE_LIMIT_TPM": "1000000000",
}


async def one_stream(
    client: httpx.AsyncClient, prompt: list[int], output_len: int = OUTPUT_LEN
) -> int:
    """One streaming completion of `output_len` tokens; the tokens its usage reports."""
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def server_run(base_url: str, prompts: list[list[int]], secured: bool = False) -> float:
    limits = httpx.Limits(max_connections=NUM_STREAMS)
    headers = {"authorization": f"Bearer {BENCH_KEY}"} if secured else {}
    async with httpx.AsyncClient(
        base_url=base_url, timeout=600, limits=limits, headers=headers
    ) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(client, p) for p in prompts))
        return sum(counts) / (time.perf_counter() - start)


def server_tokens_per_s(
    path: Path, prompts: list[list[int]], repeats: int, secured: bool = False
) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "metrale",
        "serve",
        "--model-from-path",
        str(path),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-seq-len",
        "1024",
        "--no-prefix-caching",
    ]
    env = {**os.environ, **(SECURITY_ENV if secured else {})}
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        asyncio.run(server_run(base_url, prompts[:2], secured))  # warm up
        return [asyncio.run(server_run(base_url, prompts, secured)) for _ in range(repeats)]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / ".cache" / "llama-58m")
    parser.add_argument(
        "--security",
        action="store_true",
        help="also measure with an API key and rate limits on, alternating rounds with the plain "
        "server (--repeats rounds of 2 runs each)",
    )
    args = parser.parse_args()
    path = build_checkpoint(args.checkpoint)
    prompts = workload()
    offline = offline_tokens_per_s(path, prompts, args.repeats)
    served, secured = [], []
    if args.security:
        for _ in range(args.repeats):  # alternate, so drift on the machine hits both alike
            served += server_tokens_per_s(path, prompts, 2)
            secured += server_tokens_per_s(path, prompts, 2, secured=True)
    else:
        served = server_tokens_per_s(path, prompts, args.repeats)
    med_offline, med_served = statistics.median(offline), statistics.median(served)
    result = {
        "benchmark": "serve_cpu",
        "date": datetime.date.today().isoformat(),
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "workload": {"streams": NUM_STREAMS, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN},
        "offline_tokens_per_s": offline,
        "server_tokens_per_s": served,
        "median": {"offline": med_offline, "server": med_served},
        "server_vs_offline": med_served / med_offline,
    }
    if secured:
        med_secured = statistics.median(secured)
        result["server_with_key_and_limits_tokens_per_s"] = secured
        result["median"]["server_with_key_and_limits"] = med_secured
        result["with_key_and_limits_vs_plain"] = med_secured / med_served
    suffix = "-security" if secured else ""
    out = ROOT / "results" / f"serve_cpu{suffix}-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                k: v
                for k, v in result.items()
                if k in ("median", "server_vs_offline", "with_key_and_limits_vs_plain")
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
