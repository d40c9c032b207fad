"""fifo against slai on a mixed workload: steady decodes while long prompts arrive (issue 19).

    python bench/scheduling.py [--policies fifo,slai] [--deadline-ms 50] [--out DIR]

The engine core in this process on random weights of Llama-3.1-8B's shape (`--config tiny`: a
small Llama for a CPU smoke run): `--streams` requests of 128 prompt tokens decode
`--decode-len` tokens each (EOS ignored); once all have their first token, `--long-prompts`
prompts of `--long-len` tokens arrive every `--arrival-ms`. Per policy, in the same process one
after the other: the steady requests' time between tokens while the long prompts arrive (each
token's time is when `step()` handed it back), its p50 / p90 / p99 / max, the share of gaps over
the deadline, goodput (steady tokens per second whose gap met the deadline), the long prompts'
TTFT, and for slai the step time model it learned and a trace of the steps that prefilled.
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
    # warm up: long prompts (one of an odd length, so the kernels' variants for chunk sizes
    # that are not multiples of 16 compile here too) and a batch of decodes, so compilation is
    # out of the timed part
    for i in range(5):
        n = (args.long_len, args.long_len - 37)[i] if i < 2 else 128
        core.add_request(EngineRequest(f"warm{i}", ids(n), long, 0))
    while core.has_unfinished_requests():
        core.step()
    trace = trace_steps(core)
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
    # the gaps while long prompts arrive: from the first token after `start` on
    gaps = [
        b - a for times in token_times.values() for a, b in itertools.pairwise(times) if a >= start
    ]
    deadline = args.deadline_ms / 1e3
    ttfts = [long_first[r] - long_sent[r] for r in long_sent if r in long_first]
    # what slai learned of the step times, and the prefill it would now give a step
    policy_obj = core.scheduler.policy
    fit = policy_obj.step_time.coefficients if hasattr(policy_obj, "step_time") else None
    learned = None
    if fit is not None:
        learned = {
            "base_ms": 1e3 * fit[0],
            "us_per_prefill_token": 1e6 * fit[1],
            "us_per_1k_attention_pairs": 1e6 * fit[2],
            "first_chunk_tokens": first_chunk(policy_obj, args.max_prefill_tokens),
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
        # each step that prefilled: [prefill tokens, furthest position a chunk reached, ms
        # since the step before came back, the first chunk a prompt could have had]
        "prefill_steps": [row for row in trace if row[0] or len(row) > 4],
    }


def first_chunk(policy, max_prefill_tokens: int) -> int:
    """The tokens a step would give a prompt's first chunk now."""
    return policy.prefill_budget(max_prefill_tokens).fits(0, max_prefill_tokens)


def compiled_variants() -> dict[str, int]:
    """Each Triton kernel of metrale's and how many variants of it have compiled so far."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import metrale.kernels

    counts = {}
    for info in pkgutil.iter_modules(metrale.kernels.__path__):
        module = importlib.import_module(f"metrale.kernels.{info.name}")
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                caches = getattr(fn, "device_caches", {})
                counts[f"{info.name}.{name}"] = sum(len(c[0]) for c in caches.values())
    return counts


def trace_steps(core) -> list[list[float]]:
    """From now on, a row per step the scheduler takes back (see `prefill_steps`); a step
    during which Triton kernels compiled new variants also names them."""
    scheduler = core.scheduler
    rows: list[list[float]] = []
    update, schedule = scheduler.update, scheduler.schedule
    state = {"last": None, "budget": {}, "variants": compiled_variants()}

    def traced_schedule():
        budget = first_chunk(scheduler.policy, scheduler.config.max_prefill_tokens)
        out = schedule()
        state["budget"][id(out)] = budget
        return out

    def traced_update(scheduled, result):
        now = time.perf_counter()
        chunks = [c for c in scheduled.chunks if c.num_tokens > 1]
        budget = state["budget"].pop(id(scheduled), None)
        if state["last"] is not None:
            reach = max((c.start_pos + c.num_tokens for c in chunks), default=0)
            ms = 1e3 * (now - state["last"])
            rows.append([sum(c.num_tokens for c in chunks), reach, round(ms, 3), budget])
            variants = compiled_variants()
            if grew := sorted(k for k, v in variants.items() if v > state["variants"].get(k, 0)):
                rows[-1].append(grew)
            state["variants"] = variants
        state["last"] = now
        return update(scheduled, result)

    scheduler.schedule, scheduler.update = traced_schedule, traced_update
    return rows


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
