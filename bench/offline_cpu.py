"""Offline generation speed on this CPU, against Hugging Face transformers in the same run.

A ~58M-parameter Llama-shaped checkpoint with random weights (built once with transformers and
saved, so both engines load the very same tensors), fp32, greedy, EOS ignored:

- B1 decode: one request, prompt 128 tokens; decode tokens/s = 128 / (t(129 new) - t(1 new)),
  which cancels the prefill and start-up for both engines alike.
- 16 requests: prompts uniform in [32, 512] tokens, outputs uniform in [32, 256], seed 0;
  output tokens/s over the whole batch. transformers runs them one at a time and, separately,
  as one left-padded batch (which must decode until the longest request is done; only the
  tokens each request asked for are counted).

Each figure, on both sides, is the median of --repeats runs, engines interleaved; Metrale runs
without its prefix cache (each repeat times the same prompts, which transformers recomputes;
before 2026-12-02 the cache let repeats after the first skip most prefills, and transformers'
sequential figure was one run). The machine's copy bandwidth
is measured in the same run, and B1 is also given as a fraction of the memory roofline (bytes a
decode step must read / copy bandwidth): both engines are bound by it on this CPU. Results go to
bench/results/offline_cpu-<date>.json.

    python bench/offline_cpu.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from hf_reference import left_padded
from provenance import git_sha, metrale_tree

from metrale import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent
SHAPE = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
)


def build_checkpoint(path: Path) -> Path:
    if not (path / "model.safetensors").is_file():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
        model.save_pretrained(path, safe_serialization=True)
        tokenizer_dir = Path(__file__).resolve().parents[1] / "metrale" / "demo" / "tokenizer"
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return path


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Ours:
    def __init__(self, path: Path) -> None:
        # No prefix cache: every repeat times the same prompts, and transformers recomputes them.
        self.llm = LLM(
            model_from_path=str(path),
            dtype="float32",
            max_seq_len=1024,
            enable_prefix_caching=False,
        )

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> None:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        self.llm.generate(prompts, params, use_tqdm=False)


class HF:
    def __init__(self, path: Path) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        ).eval()
        self.model.generation_config.eos_token_id = None

    def generate_one(self, prompt: list[int], n: int) -> None:
        self.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> None:
        for prompt, n in zip(prompts, output_lens, strict=True):
            self.generate_one(prompt, n)

    def generate_padded(self, prompts: list[list[int]], output_lens: list[int]) -> None:
        ids, mask = left_padded(prompts)
        n = max(output_lens)
        self.model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )


def copy_bandwidth_gb_s() -> float:
    """This machine's memory bandwidth: a 512 MiB copy, bytes read plus written, best of 5."""
    src = torch.ones(128 * 2**20)
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * src.element_size() / best / 1e9


def b1_bytes_per_token(model: torch.nn.Module, context_len: int) -> int:
    """Bytes a batch-1 decode step must read: every weight but the embedding table (one row of
    it), plus the KV cache of the context."""
    config = model.config
    weights = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n
    )
    embedding_row = config.hidden_size * 4
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * context_len * config.num_key_value_heads * head_dim * 4
    return weights + embedding_row + kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / ".cache" / "llama-58m")
    args = parser.parse_args()

    path = build_checkpoint(args.checkpoint)
    ours, hf = Ours(path), HF(path)
    num_params = sum(p.numel() for p in hf.model.parameters())
    g = torch.Generator().manual_seed(0)
    prompt128 = torch.randint(10, 4000, (128,), generator=g).tolist()
    prompts16 = [
        torch.randint(10, 4000, (int(n),), generator=g).tolist()
        for n in torch.randint(32, 513, (16,), generator=g)
    ]
    outputs16 = torch.randint(32, 257, (16,), generator=g).tolist()
    total16 = sum(outputs16)

    ours.generate([prompt128[:16]], [4])  # warm up both
    hf.generate_one(prompt128[:16], 4)
    runs: dict[str, list[float]] = {
        k: [] for k in ("ours_b1", "hf_b1", "ours_16", "hf_16_seq", "hf_16_padded")
    }
    for r in range(args.repeats):
        runs["ours_b1"].append(
            128
            / (
                timed(lambda: ours.generate([prompt128], [129]))
                - timed(lambda: ours.generate([prompt128], [1]))
            )
        )
        runs["hf_b1"].append(
            128
            / (
                timed(lambda: hf.generate_one(prompt128, 129))
                - timed(lambda: hf.generate_one(prompt128, 1))
            )
        )
        runs["ours_16"].append(total16 / timed(lambda: ours.generate(prompts16, outputs16)))
        runs["hf_16_padded"].append(
            total16 / timed(lambda: hf.generate_padded(prompts16, outputs16))
        )
        runs["hf_16_seq"].append(total16 / timed(lambda: hf.generate(prompts16, outputs16)))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items() if v))

    med = {k: statistics.median(v) for k, v in runs.items()}
    bandwidth = copy_bandwidth_gb_s()
    # The B1 step reads its weights once per token; the average context is prompt + 64.
    roofline = bandwidth * 1e9 / b1_bytes_per_token(hf.model, 128 + 64)
    result = {
        "benchmark": "offline_cpu",
        "date": datetime.date.today().isoformat(),
        "git_sha": git_sha(),
        "metrale_tree": metrale_tree(),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "model": {"shape": SHAPE, "num_params": num_params, "dtype": "float32"},
        "tokens_per_s_median": med,
        "copy_bandwidth_gb_s": bandwidth,
        "b1_roofline_tokens_per_s": roofline,
        "runs": runs,
        "ratios": {
            "b1_decode_vs_hf": med["ours_b1"] / med["hf_b1"],
            "b1_decode_vs_roofline": med["ours_b1"] / roofline,
            "hf_b1_decode_vs_roofline": med["hf_b1"] / roofline,
            "16_requests_vs_hf_sequential": med["ours_16"] / med["hf_16_seq"],
            "16_requests_vs_hf_padded_batch": med["ours_16"] / med["hf_16_padded"],
        },
    }
    out = ROOT / "results" / f"offline_cpu-{result['date']}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                "tokens_per_s_median": med,
                "ratios": result["ratios"],
                "copy_bandwidth_gb_s": bandwidth,
                "b1_roofline": roofline,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
