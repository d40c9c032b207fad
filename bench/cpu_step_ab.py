"""The CPU engine's decode step, for A/B runs of two packages: the offline engine on
profile_cpu.py's 33.6M-parameter Llama (fp32, 128-token prompts, greedy), stepped by
`EngineCore.step` in this process at 1 stream and at 16, `--rounds` times on one engine. Prints
one JSON line: the median and 10th percentile of the decode steps' times per round (noise only
adds time, so the low percentile resolves what the median does not).

Which package runs is PYTHONPATH's choice (and `--enforce-eager` keeps a package's CPU decode
steps uncompiled); run the two alternately, round for round:

    git worktree add bench/.baseline <commit>
    for i in 1 2 3; do
        PYTHONPATH=bench/.baseline python bench/cpu_step_ab.py --label before
        PYTHONPATH=. python bench/cpu_step_ab.py --label after
    done
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from profile_cpu import ROOT, checkpoint, decode_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--prompt-len", type=int, default=128, help="tokens a prompt (the decodes' context)"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no compiled one-row decode steps"
    )
    args = parser.parse_args()
    import metrale
    from metrale import LLM

    path = checkpoint(ROOT / ".cache" / "llama-34m")
    llm = LLM(
        model_from_path=str(path),
        dtype=args.dtype,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        max_seq_len=args.prompt_len + 256,
        # every prompt in one step: the steps timed after it are decodes
        max_prefill_tokens=max(2048, 16 * args.prompt_len),
    )
    result: dict[str, object] = {
        "label": args.label,
        "package": str(Path(metrale.__file__).parent),
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
    }
    for streams in (1, 16):
        decode_steps(llm, streams, f"warm{streams}", args.prompt_len)
        medians, lows = [], []
        for r in range(args.rounds):
            times = sorted(decode_steps(llm, streams, f"r{streams}-{r}", args.prompt_len))
            medians.append(1e3 * times[len(times) // 2])
            lows.append(1e3 * times[len(times) // 10])
        result[f"{streams}_stream_median_ms"] = statistics.median(medians)
        result[f"{streams}_stream_p10_ms"] = statistics.median(lows)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
