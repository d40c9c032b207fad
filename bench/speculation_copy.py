"""N-gram speculation on a copy-heavy request at batch 1: a real model asked to give back a code
file of about 1,500 tokens with one change, greedy, with and without `--speculative-config
ngram`, alternating in one process. Reports output tokens/s of each (the whole request, and
the decode alone: the request less a one-token run of it), their ratio, whether the outputs are
identical token for token, and the drafts' acceptance.

    python bench/speculation_copy.py --model FILE.gguf [--dtype bfloat16] [--repeats 3]
        [--num-speculative-tokens 4 8] [--max-tokens 2048] [--out DIR]

The code file is `bench/data/copy_heavy_source.py.txt` (a snapshot of one of our modules, so the
request stays the same as the package changes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
from provenance import git_sha, metrale_tree

from metrale import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent
SOURCE = ROOT / "data" / "copy_heavy_source.py.txt"
ASK = (
    "Here is a Python module:\n\n```python\n{code}```\n\n"
    "Rewrite the whole module with the function `_xtc` renamed to `_exclude_top_choices` "
    "(its definition and every call). Reply with the complete module in one code block."
)


def prompt_ids(llm: LLM) -> list[int]:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": ASK.format(code=SOURCE.read_text())}],
        add_generation_prompt=True,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, list(out.token_ids)


def variant_flags(k: int) -> dict:
    return {} if k == 0 else {"speculative_config": "ngram", "num_speculative_tokens": k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory or GGUF file")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="e.g. gguf: weights stay packed")
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[4])
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "results")))
    args = parser.parse_args()

    ks = [0, *args.num_speculative_tokens]  # 0: no speculation, the reference
    llms = {
        k: LLM(
            model_from_path=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            num_kv_blocks=1024,  # the engines share the device: a pool of their own each
            max_seq_len=4096,
            **variant_flags(k),
        )
        for k in ks
    }
    prompt = prompt_ids(llms[0])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    runs: dict[int, list[dict]] = {k: [] for k in ks}
    outputs: dict[int, list[int]] = {}
    for k in ks:  # warm: kernels compiled, graphs captured, the prefix cache holds the prompt
        timed(llms[k], prompt, params)
    for _ in range(args.repeats):
        for k in ks:  # alternating, so drift in the machine falls on every variant alike
            llm = llms[k]
            speculator = llm.engine.scheduler.speculator
            before = None if speculator is None else speculator.stats
            seconds, tokens = timed(llm, prompt, params)
            first_s, _ = timed(llm, prompt, first)
            run = {
                "seconds": seconds,
                "first_token_s": first_s,
                "output_tokens": len(tokens),
                "tokens_per_s": len(tokens) / seconds,
                "decode_tokens_per_s": (len(tokens) - 1) / (seconds - first_s),
            }
            if speculator is not None:
                after = speculator.stats
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                run.update(draft_tokens=drafted, accepted_tokens=accepted)
            runs[k].append(run)
            outputs.setdefault(k, tokens)
            if tokens != outputs[k]:
                raise SystemExit(f"K={k}: a repeat gave other tokens than the first")
    tokenizer = llms[0].get_tokenizer()
    results = {
        "date": datetime.date.today().isoformat(),
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "prompt_tokens": len(prompt),
        "output_tokens": len(outputs[0]),
        "output_text_head": tokenizer.decode(outputs[0][:200]),
        "cuda_graphs": llms[0].engine.runner.graphs is not None,
        "variants": {},
    }
    plain = statistics.median(r["tokens_per_s"] for r in runs[0])
    plain_decode = statistics.median(r["decode_tokens_per_s"] for r in runs[0])
    for k in ks:
        rate = statistics.median(r["tokens_per_s"] for r in runs[k])
        decode = statistics.median(r["decode_tokens_per_s"] for r in runs[k])
        results["variants"][f"k{k}"] = {
            "num_speculative_tokens": k,
            "runs": runs[k],
            "tokens_per_s": rate,
            "decode_tokens_per_s": decode,
            "vs_plain": rate / plain,
            "decode_vs_plain": decode / plain_decode,
            "identical_to_plain": outputs[k] == outputs[0],
        }
        print(
            f"K={k}: {rate:.1f} tok/s ({rate / plain:.2f}x), decode {decode:.1f} tok/s "
            f"({decode / plain_decode:.2f}x), identical: {outputs[k] == outputs[0]}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"speculation_copy-{results['date']}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
