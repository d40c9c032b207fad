"""`--quantization gguf` on the GPU: the packed-weight kernels against the roofline in quantized
bytes, batch-1 decode with packed weights, and the agreement of packed and dequantized runs of
a real GGUF model.

    python bench/quant_gguf.py [--out DIR] [--smollm FILE.gguf] [--parts kernels,b1,smollm]

kernels: `quant_gemv` at Llama-3.1-8B's five weight shapes in Q8_0, Q4_0 and Q4_1 (with a launch
sweep), each replayed from a CUDA graph, its read bandwidth in quantized bytes next to the copy
bandwidth of the same run and the bfloat16 `gemv`; `quant_gemm` at 16 to 4,096 rows against
cuBLAS in bfloat16.
b1: batch-1 decode of a Llama-3.1-8B-shaped model on random weights (the serving engine, CUDA
graphs), bfloat16 against every linear layer packed in Q8_0 and in Q4_0; each against its
roofline (bytes a token reads: the weights as stored, the KV of the mean context).
smollm: SmolLM2-135M-Instruct's Q4_1 file, dequantized to bfloat16 against packed, greedy on
chat prompts: how many tokens agree, and at each first divergence the dequantized run's
top-two logprob gap (a near tie is where arithmetic order may flip the pick).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch
from cuda_timing import copy_bandwidth, graph_seconds, median_seconds
from gemv import REPEATS, SHAPES  # Llama-3.1-8B's five weight shapes
from gpu_suite import LLAMA_8B, b1_rates, engine, release

import metrale.engine.core as engine_core
from metrale import LLM, SamplingParams
from metrale.kernels.gemv import gemv
from metrale.kernels.quant_gemm import quant_gemm
from metrale.kernels.quant_gemv import quant_gemv
from metrale.layers.linear import Linear
from metrale.layers.packed_weight import PackedWeight

FORMATS = ("Q8_0", "Q4_0", "Q4_1")


def kernels(results: dict) -> None:
    x = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    out = results["kernels"] = {}
    for name, (n, k) in SHAPES.items():
        repeats = 2 if name == "lm_head" else REPEATS
        xk = x[:, :k].contiguous()
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(repeats)]
        seconds = graph_seconds(lambda ws=dense, xk=xk: [gemv(xk, w) for w in ws])
        row = out[name] = {"bf16_gemv": _rate(n * k * 2 * repeats, seconds, repeats)}
        del dense
        for fmt in FORMATS:
            weights = [PackedWeight.random(fmt, n, k, "cuda", seed=i) for i in range(repeats)]
            nbytes = sum(w.nbytes() for w in weights)
            sweep = {}
            for block_n, block_k, warps in itertools.product((4, 8, 16), (256, 512), (4, 8)):
                launch = {"block_n": block_n, "block_k": block_k, "num_warps": warps}

                def step(ws=weights, xk=xk, fmt=fmt, launch=launch) -> None:
                    for w in ws:
                        quant_gemv(xk, fmt, *w.parts, **launch)

                key = f"{block_n}x{block_k}w{warps}"
                sweep[key] = _rate(nbytes, graph_seconds(step), repeats)
            default = graph_seconds(
                lambda ws=weights, xk=xk, fmt=fmt: [quant_gemv(xk, fmt, *w.parts) for w in ws]
            )
            best = max(sweep, key=lambda key: sweep[key]["tb_per_s"])
            row[fmt] = {
                "default": _rate(nbytes, default, repeats),
                "best": best,
                "best_rate": sweep[best],
                "sweep": sweep,
            }
            print(
                f"{name:8s} {fmt}: default {row[fmt]['default']['tb_per_s']:.2f} TB/s, "
                f"best {best} {sweep[best]['tb_per_s']:.2f} TB/s; bf16 gemv "
                f"{row['bf16_gemv']['tb_per_s']:.2f} TB/s",
                flush=True,
            )
            del weights
    n, k = SHAPES["gate_up"]
    gemm = results["gemm"] = {}
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for fmt in FORMATS:
        packed = PackedWeight.random(fmt, n, k, "cuda")
        for m in (2, 16, 64, 256, 1024, 4096):
            xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            never = m + 1  # rows from which to dequantize: never, for this x

            def kernel_only(xm=xm, p=packed, fmt=fmt, never=never) -> None:
                quant_gemm(xm, fmt, *p.parts, dequantize_rows=never)

            kernel = median_seconds(kernel_only)
            via_cublas = median_seconds(
                lambda xm=xm, p=packed, fmt=fmt: quant_gemm(xm, fmt, *p.parts, dequantize_rows=0)
            )
            cublas = median_seconds(lambda xm=xm: xm @ w.t())
            gemm[f"{fmt}/m{m}"] = {
                "kernel_us": kernel * 1e6,
                "dequantize_then_cublas_us": via_cublas * 1e6,
                "cublas_bf16_us": cublas * 1e6,
                "kernel_weight_tb_per_s": packed.nbytes() / kernel / 1e12,
            }
            print(
                f"gemm {fmt} m={m}: kernel {kernel * 1e6:.0f} us, dequantize + cuBLAS "
                f"{via_cublas * 1e6:.0f} us, cuBLAS bf16 {cublas * 1e6:.0f} us",
                flush=True,
            )


def _rate(nbytes: int, seconds: float, repeats: int) -> dict[str, float]:
    return {"us": seconds / repeats * 1e6, "tb_per_s": nbytes / seconds / 1e12}


def _packing_loader(fmt: str):
    """engine_core.load_model, then every linear layer packed with random `fmt` weights."""
    load = engine_core.load_model

    def load_packed(*args, **kwargs):
        model = load(*args, **kwargs)
        for i, layer in enumerate(m for m in model.modules() if isinstance(m, Linear)):
            layer.pack_(fmt)
            n, k = layer.packed.shape
            layer.packed.copy_rows_(0, PackedWeight.random(fmt, n, k, "cuda", seed=i))
        torch.cuda.empty_cache()
        return model

    return load_packed


def b1(results: dict) -> None:
    prompt = torch.randint(0, 128000, (128,)).tolist()
    read = results["copy_tb_per_s"] * 1e12
    out = results["b1"] = {}
    for fmt in ("bf16", "Q8_0", "Q4_0"):
        original = engine_core.load_model
        if fmt != "bf16":
            engine_core.load_model = _packing_loader(fmt)
        try:
            core = engine(LLAMA_8B, max_seq_len=2048, max_num_seqs=8, gpu_memory_utilization=0.85)
        finally:
            engine_core.load_model = original
        times = b1_rates(core, prompt)
        ours = sorted(times)[1]
        model, cfg = core.runner.model, core.config.model
        weights = sum(
            (m.packed.nbytes() if m.packed is not None else m.weight.numel() * 2)
            for m in model.modules()
            if isinstance(m, Linear)
        ) + cfg.hidden_size * 2 * (2 * cfg.num_layers + 2)  # the norms and one embedding row
        kv = 2 * cfg.num_layers * cfg.kv_size * 2 * (128 + 256)  # bf16 KV of the mean context
        roofline = read / (weights + kv)
        out[fmt] = {
            "tokens_per_s": ours,
            "runs": times,
            "bytes_per_token": weights + kv,
            "roofline_tokens_per_s": roofline,
            "fraction_of_roofline": ours / roofline,
            "cuda_graphs": core.runner.graphs is not None,
        }
        print(f"B1 {fmt}: {ours:.1f} tok/s, roofline {roofline:.1f}, {100 * ours / roofline:.1f}%")
        release(core)
        del core, model
        torch.cuda.empty_cache()


SMOLLM_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a job interview.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):\n    # complete this Python function",
    "What is 17 times 23?",
    "Tell me a fact about the Moon.",
    "Write a short story about a robot who learns to paint.",
    "What are the primary colours?",
    "How do I make a cup of tea?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "List five fruits that are red.",
    "What is the difference between weather and climate?",
    "Écris une phrase en français sur le fromage.",
    "Name the planets of the solar system in order.",
    "Write a SQL query that counts the rows of a table named users.",
    "What does HTTP stand for?",
    "Give me a recipe for pancakes.",
    "What is photosynthesis?",
    "Suggest a name for a black cat.",
    "How many days are there in a leap year?",
    "Write a limerick about a programmer.",
]


def smollm(results: dict, path: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)
    runs = {}
    for label, quantization in (("dequantized", None), ("packed", "gguf")):
        llm = LLM(model_from_path=str(path), dtype="bfloat16", quantization=quantization)
        tok = llm.get_tokenizer()
        prompts = [
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for p in SMOLLM_PROMPTS
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:8]]
        core = llm.engine
        times = b1_rates(core, prompts[0])
        runs[label] = {
            "outputs": [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs],
            "alone": [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in alone],
            "text": [o.outputs[0].text for o in outputs],
            "b1_tokens_per_s": sorted(times)[1],
        }
        release(core)
        del llm, core
        torch.cuda.empty_cache()
    results["smollm"] = {
        "file": str(path),
        "prompts": len(SMOLLM_PROMPTS),
        "tokens_each": 64,
        "batched": _agreement(runs["dequantized"]["outputs"], runs["packed"]["outputs"]),
        "alone": _agreement(runs["dequantized"]["alone"], runs["packed"]["alone"]),
        "b1_tokens_per_s": {k: v["b1_tokens_per_s"] for k, v in runs.items()},
        "sample": {k: v["text"][:3] for k, v in runs.items()},
    }
    print(json.dumps({k: v for k, v in results["smollm"].items() if k != "sample"}, indent=1))


def _agreement(refs: list, ours: list) -> dict:
    """Tokens of `ours` before each sequence's first divergence from `refs`, and the top-two
    gap of the reference where it parts."""
    same_tokens = total = identical = 0
    divergences = []
    for i, ((ref, ref_lp), (out, _)) in enumerate(zip(refs, ours, strict=True)):
        total += len(ref)
        first = next((j for j, (a, b) in enumerate(zip(ref, out, strict=True)) if a != b), None)
        if first is None:
            identical += 1
            same_tokens += len(ref)
            continue
        same_tokens += first
        top = sorted((lp.logprob for lp in ref_lp[first].values()), reverse=True)[:2]
        gap = top[0] - top[1] if len(top) == 2 else None
        divergences.append({"prompt": i, "position": first, "reference_top2_gap": gap})
    return {
        "sequences": len(refs),
        "identical_sequences": identical,
        "tokens_before_first_divergence": same_tokens,
        "tokens": total,
        "divergences": divergences,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    parser.add_argument("--smollm", type=Path)
    parser.add_argument("--parts", default="kernels,b1,smollm")
    args = parser.parse_args()
    parts = args.parts.split(",")
    results: dict = {
        "benchmark": "quant_gguf",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "copy_tb_per_s": copy_bandwidth() / 1e12,
    }
    print(f"copy bandwidth {results['copy_tb_per_s']:.2f} TB/s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"quant_gguf-{results['date']}.json"
    for part in parts:
        try:
            if part == "kernels":
                kernels(results)
            elif part == "b1":
                b1(results)
            elif part == "smollm" and args.smollm is not None and args.smollm.is_file():
                smollm(results, args.smollm)
        except Exception as exc:  # keep what the other parts measured
            results[f"{part}_error"] = repr(exc)
            print(f"{part} failed: {exc!r}", flush=True)
        target.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
