"""Tensor parallelism's speed: batch-1 decode and batched throughput at each tensor-parallel size,
on random weights of a real shape (`--load-format dummy`), each size in its own engine, one
after the other in this call so the sizes compare under the same conditions.

    python bench/tensor_parallel.py --model llama_70b --tp 1,2,4,8        # an 8-GPU host
    python bench/tensor_parallel.py --model llama_8b --tp 1               # one GPU
    python bench/tensor_parallel.py --model tiny --device cpu --tp 1,2    # what CI runs

Per size it reports: the batch-1 decode's time per output token (one request of
`--prompt-len` tokens decoding `--batch1-tokens`), and, for the reference, the roofline's: the
bytes of one rank's weights read once per token at `--hbm-gbps` (4,800 for an H200; on a CPU
pass the machine's copy bandwidth); then the batched run's output tokens a second
(`--streams` requests of `--prompt-len` random ids, `--output-len` greedy tokens, EOS ignored,
B2's workload). One JSON document on stdout, and under `--out` if given.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from gpu_suite import LLAMA_8B, QWEN3_06B, model_dir

from metrale.engine.core import EngineCore
from metrale.engine.messages import EngineRequest
from metrale.engine_args import EngineArgs
from metrale.sampling_params import SamplingParams

LLAMA_70B = LLAMA_8B | {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
TINY = {  # CI's: a few MB, heads that split over 2 ranks
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
MODELS = {"llama_70b": LLAMA_70B, "llama_8b": LLAMA_8B, "qwen3_0.6b": QWEN3_06B, "tiny": TINY}


def engine(config: dict, size: int, device: str, streams: int) -> EngineCore:
    args = EngineArgs(
        model_from_path=model_dir(config),
        load_format="dummy",
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        tensor_parallel_size=size,
        max_num_seqs=max(streams, 1),
        max_seq_len=4096,
        scheduler_config="async",
    )
    return EngineCore.from_config(args.create_config(), progress=False)


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Wall seconds and output tokens of the whole batch."""
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"r{time.monotonic_ns()}-{i}", prompt, params, 0.0))
    _sync(core)
    start, num_tokens = time.perf_counter(), 0
    while core.has_unfinished_requests():
        num_tokens += sum(len(o.new_token_ids) for o in core.step())
    _sync(core)
    return time.perf_counter() - start, num_tokens


def _sync(core: EngineCore) -> None:
    if core.config.device.type == "cuda":
        torch.cuda.synchronize()


def weight_bytes_per_rank(core: EngineCore) -> int:
    """Bytes of this rank's parameters (rank 0's; every rank holds about as much)."""
    return sum(p.numel() * p.element_size() for p in core.runner.model.parameters())


def measure(config: dict, size: int, args: argparse.Namespace) -> dict:
    core = engine(config, size, args.device, args.streams)
    try:
        g = torch.Generator().manual_seed(0)
        vocab = min(config["vocab_size"], 4096)

        def prompts(n: int) -> list[list[int]]:
            return [
                torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(n)
            ]

        one = SamplingParams(temperature=0, max_tokens=args.batch1_tokens, ignore_eos=True)
        run(core, prompts(1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        seconds, tokens = run(core, prompts(1), one)
        # (the prefill is one step of the run: at batch 1 it is a small part of it)
        tpot_ms = 1e3 * seconds / tokens
        roofline_ms = 1e3 * weight_bytes_per_rank(core) / (args.hbm_gbps * 1e9)
        batched = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        b_seconds, b_tokens = run(core, prompts(args.streams), batched)
        return {
            "tensor_parallel_size": size,
            "weight_gb_per_rank": weight_bytes_per_rank(core) / 1e9,
            "batch1_tpot_ms": tpot_ms,
            "batch1_roofline_ms": roofline_ms,
            "batch1_fraction_of_roofline": roofline_ms / tpot_ms,
            "batched_streams": args.streams,
            "batched_output_tok_s": b_tokens / b_seconds,
            "kv_blocks": core.scheduler.kv_cache.pool.num_blocks,
        }
    finally:
        core.shutdown()
        del core
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama_8b")
    parser.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batch1-tokens", type=int, default=256)
    parser.add_argument("--hbm-gbps", type=float, default=4800.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = MODELS[args.model]
    sizes = [int(s) for s in args.tp.split(",")]
    results = [measure(config, size, args) for size in sizes]
    base = results[0]
    for r in results:
        r["batch1_speedup"] = base["batch1_tpot_ms"] / r["batch1_tpot_ms"]
        r["batched_speedup"] = r["batched_output_tok_s"] / base["batched_output_tok_s"]
    doc = {
        "bench": "tensor_parallel",
        "model": args.model,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "num_gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
