"""The host work `LLM.generate` does between engine steps, per step: the wall time of a
`generate` less the time inside `EngineCore.step`, over its steps. 256 requests of 128 random
ids, 64 greedy tokens each (EOS ignored), on `bench/host_step_cpu.py`'s 2-layer Qwen3 (hidden
64, the demo tokenizer); 5 rounds after a warm-up. The package is PYTHONPATH's choice:

    PYTHONPATH=bench/.mid python bench/results/cpu-2026-12-07-s60/llm_host_step.py
    PYTHONPATH=. python bench/results/cpu-2026-12-07-s60/llm_host_step.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
from host_step_cpu import checkpoint
from provenance import metrale_tree

from metrale import LLM, SamplingParams

STREAMS, PROMPT_LEN, OUTPUT_LEN, ROUNDS = 256, 128, 64, 5


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            str(checkpoint(Path(tmp))),
            max_num_seqs=STREAMS,
            max_seq_len=2048,
            max_num_batched_tokens=STREAMS * PROMPT_LEN,
            max_prefill_tokens=STREAMS * PROMPT_LEN,
            enable_prefix_caching=False,
        )
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(10, 4000, (PROMPT_LEN,), generator=g).tolist() for _ in range(STREAMS)
        ]
        params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        step, inside = llm.engine.step, [0.0, 0]

        def timed_step():
            start = time.perf_counter()
            try:
                return step()
            finally:
                inside[0] += time.perf_counter() - start
                inside[1] += 1

        llm.engine.step = timed_step
        outside_ms = []
        for _ in range(ROUNDS):
            inside[:] = [0.0, 0]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            outside_ms.append(1e3 * (time.perf_counter() - start - inside[0]) / inside[1])
    print(
        json.dumps(
            {"metrale_tree": metrale_tree(), "outside_step_ms": [round(x, 3) for x in outside_ms]}
        )
    )


if __name__ == "__main__":
    main()
