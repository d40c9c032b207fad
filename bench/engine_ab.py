"""The engine core alone, for A/B runs of two packages: the serving bench's workload (`--streams`
requests of `--prompt-len` random ids and `--output-len` tokens, greedy or at `--temperature`,
EOS ignored) stepped by `EngineCore.step` in this process, `--rounds` times on one engine, on
random weights of Qwen3-0.6B's shape. Prints one JSON line: output tok/s and ms per step of
each round, and the time of every step. Each round runs the same schedule (the same prompts,
the same step sequence), so step i of one package and step i of the other do the same work:
the median and 10th percentile of the steps' times (noise only ever adds time) resolve
differences that wall-clock throughput, spread ±10% between rounds, does not.

Which package runs is PYTHONPATH's choice, so the telemetry's cost in the engine (its step
figures, the runner's timing events) is measured without HTTP or IPC in the way:

    PYTHONPATH=bench/.baseline python bench/engine_ab.py --label before
    PYTHONPATH=. python bench/engine_ab.py --label after

`--generate` runs each round through `LLM.generate` instead (the offline API: its output
processing between steps counted, each step's time then from one step's start to the next's),
on B4's model (Qwen3-0.6B's shape with the demo tokenizer's vocabulary, so every id decodes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
from gpu_suite import ENGINE_FLAGS, QWEN3_06B, engine, release
from provenance import metrale_tree
from serve_telemetry import dummy_checkpoint

from metrale import LLM
from metrale.engine.messages import EngineRequest
from metrale.sampling_params import SamplingParams


def stepped(
    core, r: int, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[int, list[float]]:
    """Output tokens and each step's ms, the engine core stepped here."""
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"r{r}-{i}", prompt, params[i], 0.0))
    tokens, step_ms = 0, []
    while core.has_unfinished_requests():
        t = time.perf_counter()
        tokens += sum(len(o.new_token_ids) for o in core.step())
        step_ms.append(1e3 * (time.perf_counter() - t))
    return tokens, step_ms


def through_generate(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[int, list[float]]:
    """Output tokens and the ms from each step's start to the next's (the last step's to the
    end), all through `LLM.generate`."""
    starts = []
    step = llm.engine.step

    def timed_step():
        starts.append(time.perf_counter())
        return step()

    llm.engine.step = timed_step
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.engine.step
    starts.append(time.perf_counter())
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens, [1e3 * (b - a) for a, b in itertools.pairwise(starts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", required=True)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seeded", action="store_true", help="request i seeded with i")
    parser.add_argument("--generate", action="store_true", help="through LLM.generate")
    args = parser.parse_args()
    llm = None
    if args.generate:
        llm = LLM(
            model_from_path=str(dummy_checkpoint()),
            load_format="dummy",
            dtype="bfloat16",
            max_num_seqs=args.streams,
            max_seq_len=2048,
            **ENGINE_FLAGS,
        )
        core = llm.engine
    else:
        core = engine(QWEN3_06B, max_num_seqs=args.streams, max_seq_len=2048)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 4096, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.streams)
    ]
    params = [
        SamplingParams(
            temperature=args.temperature,
            max_tokens=args.output_len,
            ignore_eos=True,
            seed=i if args.seeded else None,
        )
        for i in range(args.streams)
    ]
    rounds = []
    for r in range(args.rounds + 1):  # the first warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        if llm is not None:
            tokens, step_ms = through_generate(llm, prompts, params)
        else:
            tokens, step_ms = stepped(core, r, prompts, params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if r:
            ordered = sorted(step_ms)
            rounds.append(
                {
                    "tok_per_s": tokens / seconds,
                    "ms_per_step": 1e3 * seconds / len(step_ms),
                    "step_ms_median": statistics.median(step_ms),
                    "step_ms_p10": ordered[len(ordered) // 10],
                    "step_ms": [round(ms, 4) for ms in step_ms],
                }
            )
    release(core)
    print(
        json.dumps(
            {
                "label": args.label,
                "metrale_tree": metrale_tree(),
                "sampling": vars(args),
                "rounds": rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
