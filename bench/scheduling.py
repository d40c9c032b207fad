"""fifo against slai on a mixed workload: steady decodes while long prompts arrive (issue 19).

    python bench/scheduling.py [--policies fifo,slai] [--deadline-ms 50] [--out DIR]

The engine core in this process on random weights of Llama-3.1-8B's shape (`--config tiny`: a
small Llama for a CPU smoke run): `--streams` requests of 128 prompt tokens decode
`--decode-len` tokens each (EOS ignored); once all have their first token, `--long-prompts`
prompts of `--long-len` tokens arrive every `--arrival-ms`. Per policy, in the same process one
after the other: the steady requests' time between tokens (each token's time is when `step()`
handed it back), its p50 / p90 / p99 / max, the share of gaps over the deadline, goodput (steady
tokens per second whose gap met the deadline), the long prompts' TTFT, and for slai the step
time model it learned (decode cost per step, prefill cost per token, the prefill a step gets).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch
from gpu_suite import LLAMA_8B, engine, release

from metrale.engine.messages import EngineRequest
from metrale.sampling_params import SamplingParams

TINY = LLAMA_8B | {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_scaling": None,
    "eos_token_id": 2,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def one_policy(args: argparse.Namespace, policy: str) -> dict:
    config = LLAMA_8B if args.config == "llama8b" else TINY
    cuda = torch.cuda.is_available()
    core = engine(
        config,
        max_seq_len=8192,
        max_num_seqs=args.streams + args.long_prompts,
        max_prefill_tokens=args.max_prefill_tokens,
        scheduler=policy,
        tbt_deadline_ms=args.deadline_ms if policy == "slai" else None,
        **({} if cuda else {"scheduler_config": "sync"}),
    )
    gen = torch.Generator().manual_seed(0)
    vocab = config["vocab_size"] - 1

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    steady = SamplingParams(temperature=0, max_tokens=args.decode_len, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # warm up: a long prompt and a batch of decodes, so compilation is out of the timed part
    for i in range(4):
        core.add_request(EngineRequest(f"warm{i}", ids(args.long_len if i == 0 else 128), long, 0))
    while core.has_unfinished_requests():
        core.step()
    token_times: dict[str, list[float]] = {}
    for i in range(args.streams):
        core.add_request(EngineRequest(f"s{i}", ids(128), steady, 0))
    while len(token_times) < args.streams:  # until every steady request has its first token
        for out in core.step():
            if out.new_token_ids:
                token_times.setdefault(out.request_id, []).append(time.perf_counter())
    start = time.perf_counter()
    due = [start + k * args.arrival_ms / 1e3 for k in range(args.long_prompts)]
    long_sent: dict[str, float] = {}
    long_first: dict[str, float] = {}
    while core.has_unfinished_requests() or due:
        now = time.perf_counter()
        while due and due[0] <= now:
            rid = f"long{len(long_sent)}"
            core.add_request(EngineRequest(rid, ids(args.long_len), long, 0))
            long_sent[rid] = due.pop(0)
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            if not out.new_token_ids:
                continue
            if out.request_id.startswith("long"):
                long_first.setdefault(out.request_id, now)
            else:
                token_times[out.request_id].extend([now] * len(out.new_token_ids))
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    gaps = [b - a for times in token_times.values() for a, b in itertools.pairwise(times)]
    deadline = args.deadline_ms / 1e3
    ttfts = [long_first[r] - long_sent[r] for r in long_sent if r in long_first]
    # what slai learned of the step times, and the prefill it would now give a step
    policy_obj = core.scheduler.policy
    fit = policy_obj.step_time.fit() if hasattr(policy_obj, "step_time") else None
    learned = None
    if fit is not None:
        learned = {
            "base_ms": 1e3 * fit[0],
            "us_per_prefill_token": 1e6 * fit[1],
            "prefill_budget": policy_obj.prefill_budget(args.max_prefill_tokens),
        }
    release(core)
    return {
        "policy": policy,
        "tbt_ms": {
            "p50": 1e3 * percentile(gaps, 50),
            "p90": 1e3 * percentile(gaps, 90),
            "p99": 1e3 * percentile(gaps, 99),
            "max": 1e3 * max(gaps),
            "mean": 1e3 * statistics.fmean(gaps),
        },
        "late_share": sum(g > deadline for g in gaps) / len(gaps),
        "goodput_tok_s": sum(g <= deadline for g in gaps) / wall,
        "steady_tok_s": len(gaps) / wall,
        "long_ttft_ms": {
            "mean": 1e3 * statistics.fmean(ttfts) if ttfts else None,
            "max": 1e3 * max(ttfts) if ttfts else None,
        },
        "wall_s": wall,
        "step_time_model": learned,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="fifo,slai")
    parser.add_argument("--deadline-ms", type=float, default=50.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--decode-len", type=int, default=512)
    parser.add_argument("--long-prompts", type=int, default=8)
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--arrival-ms", type=float, default=400.0)
    parser.add_argument("--max-prefill-tokens", type=int, default=2048)
    parser.add_argument("--config", choices=["llama8b", "tiny"], default="llama8b")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    results = {"arguments": vars(args) | {"out": str(args.out)}, "runs": []}
    for policy in args.policies.split(","):
        row = one_policy(args, policy)
        print(json.dumps(row))
        results["runs"].append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scheduling.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
