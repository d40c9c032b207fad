"""Metrale's engine alone on peer_cpu.py's workload: the same prompts, `--streams` requests at a
time, a new one added as one ends (as the load's clients do), greedy, `--output-len` forced
tokens, stepped in this process with no server in front: what `met serve` would give if its API
process and the client cost nothing. Run with tcmalloc preloaded where the system has it, as
`met serve`'s engine process runs. Prints one JSON line: output tokens/s.

    python bench/offline_streams.py --model DIR --prompts FILE.json [--streams 16] [--dtype D]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from metrale import LLM, SamplingParams
from metrale.engine.messages import EngineRequest


def run(llm: LLM, prompts: list[list[int]], streams: int, output_len: int) -> float:
    """Output tokens/s over the prompts, `streams` at a time."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    core = llm.engine
    waiting = iter(enumerate(prompts))

    def add_next() -> bool:
        for i, prompt in waiting:
            core.add_request(EngineRequest(f"o{time.monotonic_ns()}-{i}", prompt, params, 0.0))
            return True
        return False

    start = time.perf_counter()
    live = sum(add_next() for _ in range(streams))
    tokens = 0
    while live:
        for output in core.step():
            tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                live -= 1
                live += add_next()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="a JSON list of token ids")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    prompts = json.loads(args.prompts.read_text())
    llm = LLM(str(args.model), dtype=args.dtype, max_seq_len=2048, enable_prefix_caching=False)
    run(llm, prompts[:2], 2, args.output_len)  # warm up, as the servers are
    tokens_per_s = run(llm, prompts, args.streams, args.output_len)
    print(json.dumps({"streams": args.streams, "tokens_per_s": tokens_per_s}))


if __name__ == "__main__":
    main()
