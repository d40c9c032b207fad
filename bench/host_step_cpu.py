"""A batch's decode step on a CPU by part. By default where the model is too small to matter, so
the engine's host work and its sampling show: 256 requests (128-token prompts, 64 output tokens,
EOS ignored) on a 2-layer Qwen3 of hidden 64 and a vocabulary of 8,192, built here; or
`--model` (a directory or a GGUF file) with `--streams` requests. `--sampling` greedy, sampled at
temperature 0.6, or sampled with every request seeded (B2's sampling).

Prints one JSON line: the median wall ms of a decode step, and ms a decode step in the engine's
parts (each timed around its call: scheduling, the runner's input buffers, the sampler's inputs,
the whole launch with the forward and the sampling, the update; the prefill step's left out).

    python bench/host_step_cpu.py [--sampling greedy|sampled|seeded] [--rounds 3]
        [--model PATH --streams 16] [--prompt-len 128 --output-len 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from phase_clock import PhaseClock
from profile_cpu import timed_decode_steps

from metrale import LLM, SamplingParams
from metrale.engine.messages import EngineRequest
from metrale.engine.scheduler import Scheduler
from metrale.runner.model_runner import ModelRunner
from metrale.runner.sampling_inputs import SamplingInputs

ROOT = Path(__file__).resolve().parent
PARTS = {
    "schedule": (Scheduler, "schedule"),
    "fill_inputs": (ModelRunner, "_fill_inputs"),
    "sampling_inputs": (SamplingInputs, "prepare"),
    "launch": (ModelRunner, "launch"),
    "update": (Scheduler, "update"),
}


def checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=8192,
        max_position_embeddings=4096,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer_dir = ROOT.parent / "metrale" / "demo" / "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return path


def timed_parts() -> PhaseClock:
    """A clock of each part's seconds (`PhaseClock.take` reads and clears it)."""
    clock = PhaseClock()
    for label, (owner, name) in PARTS.items():
        clock.wrap(owner, name, label)
    return clock


def decode_steps(
    llm: LLM,
    streams: int,
    sampling: str,
    tag: str,
    prompt_len: int = 128,
    output_len: int = 64,
    prefilled: Callable[[], object] | None = None,
) -> list[float]:
    """Wall seconds of each step after the one that prefills every prompt (after which
    `prefilled` is called)."""
    g = torch.Generator().manual_seed(0)
    for i in range(streams):
        params = SamplingParams(
            temperature=0.0 if sampling == "greedy" else 0.6,
            max_tokens=output_len,
            ignore_eos=True,
            seed=i if sampling == "seeded" else None,
        )
        prompt = torch.randint(10, 4000, (prompt_len,), generator=g).tolist()
        llm.engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params, 0.0))
    return timed_decode_steps(llm, prefilled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sampling", choices=["greedy", "sampled", "seeded"], default="seeded")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", help="default: the tiny Qwen3 built here")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128, help="B2's contexts: 1000")
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            args.model or str(checkpoint(Path(tmp))),
            max_num_seqs=args.streams,
            max_seq_len=2048,
            max_num_batched_tokens=args.streams * args.prompt_len,
            max_prefill_tokens=args.streams * args.prompt_len,
            enable_prefix_caching=False,
        )
        lens = (args.prompt_len, args.output_len)
        decode_steps(llm, args.streams, args.sampling, "warm", *lens)
        clock = timed_parts()
        rounds = []
        for r in range(args.rounds):
            # the parts of the decode steps only: the prefill step's are cleared
            times = decode_steps(llm, args.streams, args.sampling, f"r{r}", *lens, clock.take)
            seconds, _ = clock.take()
            parts = {k: round(1e3 * v / len(times), 3) for k, v in seconds.items()}
            rounds.append({"step_ms_median": 1e3 * statistics.median(times), "parts_ms": parts})
    model = args.model or "tiny Qwen3"
    print(
        json.dumps(
            {"model": model, "sampling": args.sampling, "streams": args.streams, "rounds": rounds}
        )
    )


if __name__ == "__main__":
    main()
