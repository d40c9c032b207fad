"""Engine flags: one dataclass shared by `met` subcommands and the offline `LLM` class.

`EngineArgs` is what the user typed; `create_config()` resolves it once into an `EngineConfig`
(engine_config.py). This module imports no torch: `met serve` parses its flags and starts the
engine process before the API process imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from metrale.checkpoint.resolve import resolve_model_dir
from metrale.config import KV_CACHE_DTYPE_NAMES, PREEMPTION_MODES
from metrale.engine.scheduling_policy import POLICIES
from metrale.engine.speculation.config import SpeculativeConfig

if TYPE_CHECKING:
    from metrale.engine_config import EngineConfig

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: write e.g. 2GiB, 512MiB or 1000000000")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


# Prompt tokens per step by default. A prefill step's host work (the eager launches of every
# layer's kernels) hardly depends on its tokens, so on a GPU small steps leave it waiting on the
# host: B5's 64 x 2048-token prompts on Qwen3-0.6B took 1.61 s at 2,048 tokens a step (about
# 0.7 s of it kernels) and 0.50 s at 8,192 on the H200 (`bench/gpu_suite.py profile_b5`). vLLM
# and SGLang chunk at 8,192 on GPUs of this size too. On a CPU the products bound a step, and
# they reach the cores' peak by 256 rows (peers.md's Llama on 2 cores: 182 GFLOP/s at 128 rows,
# 194 at 256, 197 at 2,048), so chunks of 256 lose nothing to bigger ones, and prompts that
# arrive together get their first tokens in turn instead of all at the end: 16 streams' median
# TTFT 613-646 -> 184-393 ms, for 3-10% of the throughput, lost at a run's staggered start and
# finish (`bench/peer_cpu.py --against-args`, BENCHMARKS.md).
GPU_PREFILL_TOKENS = 8192
CPU_PREFILL_TOKENS = 256


@dataclass
class EngineArgs:
    model: str | None = None
    model_from_path: str | None = None
    gguf_file: str | None = None  # which GGUF file of a directory or repository
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    seed: int = 0
    max_seq_len: int | None = None
    max_num_seqs: int = 128
    max_batch_size: int | None = None
    max_prefill_tokens: int | None = None  # GPU_PREFILL_TOKENS on a GPU, else CPU_PREFILL_TOKENS
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: str = "1GiB"
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    swap_space_gb: float = 0.0
    preemption_mode: str = "auto"
    enable_prefix_caching: bool = True
    chat_template: str | None = None
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_cuda_graph_batch: int = 512
    max_cuda_graph_tokens: int = 0  # 0: steps with prompt tokens run eagerly
    enforce_eager: bool = False
    scheduler_config: str = "auto"
    scheduler: str = "fifo"
    tbt_deadline_ms: float | None = None
    disable_log_stats: bool = False
    speculative_config: str | None = None
    num_speculative_tokens: int | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None
    shared_lookup: bool = False
    shared_lookup_entries: int | None = None
    speculation_cost_model: bool | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = EngineArgs
        g = parser.add_argument_group("model")
        g.add_argument(
            "--model-from-path",
            metavar="DIR",
            help="load the checkpoint in DIR (config.json, safetensors, tokenizer.json), or a "
            "GGUF file, instead of a Hugging Face id",
        )
        g.add_argument(
            "--gguf-file",
            metavar="NAME",
            help="the GGUF file to serve when the directory or Hugging Face repository holds "
            "several (only it is downloaded)",
        )
        g.add_argument(
            "--dtype",
            default=d.dtype,
            choices=["auto", "float32", "bfloat16", "float16"],
            help="weight and activation dtype; auto takes the checkpoint's",
        )
        g.add_argument(
            "--device", default=d.device, help="cpu, cuda, cuda:N or auto (a GPU when there is one)"
        )
        g.add_argument(
            "--load-format",
            default=d.load_format,
            choices=["auto", "safetensors", "gguf", "dummy"],
            help="auto: the GGUF file the model came from, else its safetensors; dummy: random "
            "weights of the checkpoint's shapes (benchmarks)",
        )
        g.add_argument(
            "--quantization",
            default=d.quantization,
            choices=["gguf"],
            help="gguf: keep a GGUF file's Q8_0, Q4_0 and Q4_1 linear weights packed; on a GPU "
            "the products read them quantized (Triton), elsewhere each layer is dequantized as "
            "it runs. Default: dequantize every tensor to --dtype at load",
        )
        g.add_argument("--seed", type=int, default=d.seed, help="seed for dummy weights")
        g.add_argument(
            "--chat-template",
            metavar="FILE",
            help="a Jinja chat template that replaces the checkpoint's",
        )
        g.add_argument(
            "--attention-backend",
            default=d.attention_backend,
            choices=["auto", "torch", "triton"],
            help="attention kernels: triton (paged, GPU) or torch (reference, any device); "
            "auto picks triton on a GPU",
        )
        g.add_argument(
            "--max-cuda-graph-batch",
            type=int,
            default=d.max_cuda_graph_batch,
            help="capture decode steps in CUDA graphs up to this batch size (GPU)",
        )
        g.add_argument(
            "--max-cuda-graph-tokens",
            type=int,
            default=d.max_cuda_graph_tokens,
            metavar="N",
            help="capture steps with prompt tokens of up to N tokens in CUDA graphs, in pieces "
            "around attention (GPU; 0, the default: run them eagerly; not yet measured on a GPU)",
        )
        g.add_argument(
            "--enforce-eager",
            action="store_true",
            help="run every step eagerly: no CUDA graphs (GPU), no compiled decode steps (CPU)",
        )
        g = parser.add_argument_group("scheduling")
        g.add_argument(
            "--max-seq-len",
            type=int,
            help="longest prompt + output, in tokens "
            "(default: the model's max_position_embeddings)",
        )
        g.add_argument(
            "--max-num-seqs",
            type=int,
            default=d.max_num_seqs,
            help="requests holding KV cache at once",
        )
        g.add_argument(
            "--max-batch-size",
            type=int,
            help="requests in one forward step (default: --max-num-seqs)",
        )
        g.add_argument(
            "--max-prefill-tokens",
            type=int,
            default=d.max_prefill_tokens,
            help=f"prompt tokens computed per step; longer prompts are chunked (default: "
            f"{GPU_PREFILL_TOKENS} on a GPU, {CPU_PREFILL_TOKENS} on CPU)",
        )
        g.add_argument(
            "--max-num-batched-tokens",
            type=int,
            help="all tokens computed per step (default: --max-prefill-tokens + --max-batch-size)",
        )
        g.add_argument(
            "--scheduler-config",
            default=d.scheduler_config,
            choices=["auto", "sync", "async"],
            help="async: schedule and prepare the next step while the GPU runs this one; "
            "auto picks async on a GPU",
        )
        g.add_argument(
            "--scheduler",
            "--scheduling-policy",
            default=d.scheduler,
            type=lambda v: "fifo" if v == "fcfs" else v,  # vLLM's name for fifo
            choices=list(POLICIES),
            help="the order requests are served in: fifo (arrival; vLLM's fcfs), priority "
            "(each request's priority field, lowest first), slai (deadline-aware: no new prompt "
            "while a running request nears --tbt-deadline-ms since its last token, each step's "
            "prefill sized to the deadline from the step times seen; shortest prompts first "
            "after the queue's front)",
        )
        g.add_argument(
            "--tbt-deadline-ms",
            type=float,
            default=d.tbt_deadline_ms,
            help="slai: the time between tokens a running request should not exceed",
        )
        g = parser.add_argument_group("KV cache")
        g.add_argument(
            "--block-size", type=int, default=d.block_size, help="tokens per KV-cache block"
        )
        g.add_argument(
            "--kv-cache-memory",
            default=d.kv_cache_memory,
            help="memory for the KV pool on CPU, e.g. 4GiB (GPU: --gpu-memory-utilization)",
        )
        g.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=d.gpu_memory_utilization,
            help="share of the GPU's memory the engine may use; the KV pool takes what the "
            "weights and activations leave",
        )
        g.add_argument(
            "--num-kv-blocks",
            type=int,
            help="size the KV pool in blocks instead (overrides --kv-cache-memory)",
        )
        g.add_argument(
            "--kv-cache-dtype",
            default=d.kv_cache_dtype,
            choices=KV_CACHE_DTYPE_NAMES,
            help="stored keys and values: auto (the model's dtype) or fp8 (= fp8_e4m3): half "
            "the memory and bytes read per step of bf16, values saturated, no scales",
        )
        g.add_argument(
            "--swap-space-gb",
            "--swap-space",
            type=float,
            default=d.swap_space_gb,
            metavar="GIB",
            help="host memory (GiB; pinned next to a GPU) that preempted requests' KV blocks are "
            "copied to and back from, instead of recomputing their tokens, where the copy is "
            "the cheaper (both measured at startup). Default 0: always recompute",
        )
        g.add_argument(
            "--preemption-mode",
            default=d.preemption_mode,
            choices=list(PREEMPTION_MODES),
            help="with --swap-space-gb, how a preempted request gives up its KV blocks: auto "
            "(swapped when the copies cost less than recomputing its tokens), swap (whenever "
            "the swap space has room), recompute",
        )
        g.add_argument(
            "--no-prefix-caching",
            dest="enable_prefix_caching",
            action="store_false",
            help="do not reuse KV blocks of shared prefixes",
        )
        SpeculativeConfig.add_cli_args(parser)
        g = parser.add_argument_group("parallelism")
        g.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=d.tensor_parallel_size,
            help="split the model over this many ranks (GPUs of this host, or CPU processes): "
            "query and KV heads, the MLP and the vocabulary; rank 0 is the engine process, "
            "the others its worker processes (torch.distributed: NCCL, gloo on a CPU)",
        )
        g.add_argument(
            "--data-parallel-size",
            "-dp",
            type=int,
            default=d.data_parallel_size,
            help="run this many engine cores (each on its own tensor-parallel-size GPUs, or "
            "CPU processes) behind the one API server; a request goes to the core that last "
            "served a prompt starting as it does (its prefix cache), unless that core is busier "
            "than the least loaded",
        )
        g.add_argument(
            "--nnodes",
            type=int,
            help="hosts the tensor-parallel ranks span, as many on each (default: NNODES, else "
            "1); node 0 runs the API server, the others `met serve` with their --node-rank",
        )
        g.add_argument(
            "--node-rank",
            type=int,
            help="this host's place among --nnodes (default: NODE_RANK, else 0); a node past 0 "
            "only runs its ranks, and serves no API",
        )
        g.add_argument(
            "--master-addr", help="node 0's address for the ranks to meet (default: MASTER_ADDR)"
        )
        g.add_argument("--master-port", type=int, help="its port for them (default: MASTER_PORT)")
        g = parser.add_argument_group("statistics")
        g.add_argument(
            "--disable-log-stats",
            action="store_true",
            help="no statistics: the engine times no steps and the server keeps no Prometheus "
            "series (/metrics answers 404); /v1/events still tells requests and load",
        )

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    @property
    def is_demo(self) -> bool:
        return self.model is None and self.model_from_path is None

    def resolve_model_dir(self) -> Path:
        """The checkpoint directory: the demo's (generated on first use), a path, or an id."""
        from metrale import demo

        if self.is_demo:
            return demo.ensure_checkpoint()
        return resolve_model_dir(self.model, self.model_from_path, self.gguf_file)

    def create_config(self, model_dir: Path | None = None) -> EngineConfig:
        """Resolve these flags once: the model directory found, dtype and device chosen, the KV
        pool sized (`engine_config.py`, which imports torch)."""
        from metrale.engine_config import create_config

        return create_config(self, model_dir or self.resolve_model_dir())
