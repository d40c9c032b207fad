"""Engine flags: one dataclass shared by `met` subcommands and the offline `LLM` class.

`EngineArgs` is what the user typed; `create_config()` resolves it once into an `EngineConfig`
(model directory found, dtype and device chosen, KV pool sized), so nothing downstream reads a
flag twice or has to guess a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from metrale import envs
from metrale.checkpoint.resolve import resolve_model_dir
from metrale.config import (
    KV_CACHE_DTYPE_NAMES,
    PREEMPTION_MODES,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    is_fp8,
    parse_dtype,
    parse_kv_cache_dtype,
)
from metrale.distributed.launch import Launch
from metrale.engine.scheduling_policy import POLICIES
from metrale.engine.speculation.config import SpeculativeConfig
from metrale.generation_config import GenerationDefaults
from metrale.layers.attention import resolve_backend

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    model_name: str
    model: ModelConfig
    generation: GenerationDefaults
    dtype: torch.dtype
    device: torch.device
    load_format: str
    seed: int
    cache: CacheConfig
    scheduler: SchedulerConfig
    chat_template: Path | None
    is_demo: bool
    attention_backend: str = "torch"
    max_cuda_graph_batch: int = 0  # 0: no CUDA graphs
    compile_cpu_decode: bool = False  # a CPU's decode steps through torch.compile
    tokenizer_eos_token_id: int | None = None
    async_scheduling: bool = False  # prepare step N+1 while step N runs
    quantization: str | None = None  # gguf: GGUF linear weights stay packed
    log_stats: bool = True  # each step's figures (StepStats) and the server's /metrics
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # Engine cores behind the API server (--data-parallel-size), and which one this is: core i
    # runs on the devices from i x tensor_parallel_size on.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    launch: Launch = field(default_factory=Launch)  # the nodes the ranks run on

    def for_core(self, rank: int) -> EngineConfig:
        """This config as data-parallel core `rank` runs it: on its own devices."""
        device = self.device
        if device.type == "cuda":
            device = torch.device("cuda", rank * self.model.tensor_parallel_size)
        return dataclasses.replace(self, data_parallel_rank=rank, device=device)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """generation_config.json's, config.json's and the tokenizer's EOS, as vLLM takes them."""
        tokenizer_eos = (
            () if self.tokenizer_eos_token_id is None else (self.tokenizer_eos_token_id,)
        )
        return tuple(
            dict.fromkeys(self.generation.eos_token_ids + self.model.eos_token_ids + tokenizer_eos)
        )


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
        from metrale import demo

        is_demo = self.is_demo
        model_dir = model_dir or self.resolve_model_dir()
        model_config = ModelConfig.from_dir(model_dir).with_tensor_parallel(
            self.tensor_parallel_size
        )
        dtype = model_config.dtype if self.dtype == "auto" else parse_dtype(self.dtype)
        kv_cache_dtype = parse_kv_cache_dtype(self.kv_cache_dtype, dtype)
        device = _resolve_device(self.device)
        launch = Launch.from_flags(self.nnodes, self.node_rank, self.master_addr, self.master_port)
        _check_ranks(self.tensor_parallel_size, self.data_parallel_size, launch, device)
        if self.quantization == "gguf":
            from metrale.runner.model_loader import weights_format

            if (kind := weights_format(model_dir, self.load_format)) != "gguf":
                raise ValueError(
                    f"--quantization gguf keeps a GGUF file's weights packed, and {model_dir} "
                    f"loads as {kind}: serve a .gguf file"
                )

        max_seq_len = self.max_seq_len or model_config.max_position_embeddings
        if max_seq_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings})"
            )
        max_batch_size = min(self.max_batch_size or self.max_num_seqs, self.max_num_seqs)
        max_prefill_tokens = self.max_prefill_tokens or (
            GPU_PREFILL_TOKENS if device.type == "cuda" else CPU_PREFILL_TOKENS
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            max_num_batched_tokens=self.max_num_batched_tokens
            or max_prefill_tokens + max_batch_size,
            max_seq_len=max_seq_len,
            policy=self.scheduler,
            tbt_deadline_ms=self.tbt_deadline_ms,
            preemption_mode=self.preemption_mode,
        )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is out of range: "
                f"must be in (0, 1]"
            )
        num_blocks = self.num_kv_blocks
        if num_blocks is None and device.type != "cuda":
            budget = parse_bytes(self.kv_cache_memory)
            num_blocks = _num_blocks_for(budget, model_config, self.block_size, kv_cache_dtype)
        if not (math.isfinite(self.swap_space_gb) and self.swap_space_gb >= 0):
            raise ValueError(f"swap_space_gb={self.swap_space_gb} is out of range: must be >= 0")
        per_block = CacheConfig.bytes_per_block(model_config, self.block_size, kv_cache_dtype)
        cache = CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            dtype=kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_host_blocks=int(self.swap_space_gb * 2**30 // per_block),
        )
        return EngineConfig(
            model_dir=model_dir,
            model_name=demo.MODEL_NAME if is_demo else (self.model or str(model_dir)),
            model=model_config,
            generation=_generation_defaults(model_dir, model_config),
            dtype=dtype,
            device=device,
            load_format=self.load_format,
            quantization=self.quantization,
            seed=self.seed,
            cache=cache,
            scheduler=scheduler,
            chat_template=Path(self.chat_template) if self.chat_template else None,
            is_demo=is_demo,
            tokenizer_eos_token_id=_tokenizer_eos(model_dir, model_config),
            attention_backend=resolve_backend(self.attention_backend, device),
            # (the ranks past 0 do not replay graphs yet: tensor parallelism runs eager)
            max_cuda_graph_batch=0
            if self.enforce_eager or device.type != "cuda" or self.tensor_parallel_size > 1
            else self.max_cuda_graph_batch,
            compile_cpu_decode=not self.enforce_eager
            and device.type == "cpu"
            and self.tensor_parallel_size == 1
            and self.quantization is None
            and not is_fp8(kv_cache_dtype)
            and resolve_backend(self.attention_backend, device) == "torch"
            and envs.compile_cpu_decode(),
            async_scheduling=self.scheduler_config == "async"
            or (self.scheduler_config == "auto" and device.type == "cuda"),
            log_stats=not self.disable_log_stats,
            speculative=SpeculativeConfig.parse(
                self.speculative_config,
                self.num_speculative_tokens,
                self.ngram_min,
                self.ngram_max,
                self.shared_lookup,
                self.shared_lookup_entries,
                self.speculation_cost_model,
            ),
            data_parallel_size=self.data_parallel_size,
            launch=launch,
        )


def _check_ranks(
    tensor_parallel_size: int, data_parallel_size: int, launch: Launch, device: torch.device
) -> None:
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} is out of range: must be >= 1")
    if launch.nnodes > 1 and data_parallel_size > 1:
        raise ValueError(
            "data parallelism across nodes is not supported: run a server on each node (or "
            "--data-parallel-size on one node)"
        )
    num_ranks = launch.ranks_per_node(tensor_parallel_size) * data_parallel_size
    if device.type == "cuda" and 1 < num_ranks > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size="
            f"{data_parallel_size} needs {num_ranks} GPUs, a GPU per rank; this host has "
            f"{torch.cuda.device_count()}"
        )


def _tokenizer_eos(model_dir: Path, model: ModelConfig) -> int | None:
    """The tokenizer's EOS id, once the tokenizer is checked to fit the model's vocabulary."""
    if not (model_dir / "tokenizer.json").is_file():
        return None  # dummy-weight benchmarks may ship config.json alone
    from metrale.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    tokenizer.check_fits_vocab(model.vocab_size)
    eos_id = tokenizer.eos_token_id
    if eos_id is not None and eos_id >= model.vocab_size:
        # An added token past the embedding: the model can never sample it, and masking it
        # (min_tokens) would index past the logits.
        logger.warning(
            "the tokenizer's EOS token id %d is outside the model's vocabulary of %d: ignoring it",
            eos_id,
            model.vocab_size,
        )
        return None
    return eos_id


def _generation_defaults(model_dir: Path, model: ModelConfig) -> GenerationDefaults:
    """generation_config.json's defaults, checked now so that no request fails on them later."""
    from metrale.sampling_params import SamplingParams

    defaults = GenerationDefaults.from_dir(model_dir)
    path = model_dir / "generation_config.json"
    bad_eos = [t for t in defaults.eos_token_ids if t >= model.vocab_size]
    if bad_eos:
        raise ValueError(
            f"{path}: eos_token_id {bad_eos[0]} is outside the model's vocabulary of "
            f"{model.vocab_size} tokens (config.json vocab_size): the files come from different "
            f"models"
        )
    try:
        SamplingParams(**defaults.sampling_overrides())
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} holds sampling defaults no request could use: {e}") from e
    return defaults


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA device is visible: use --device cpu")
    return device


def _num_blocks_for(
    budget_bytes: int, model: ModelConfig, block_size: int, dtype: torch.dtype
) -> int:
    per_block = CacheConfig.bytes_per_block(model, block_size, dtype)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={budget_bytes} bytes holds no block of {per_block} bytes: "
            f"raise --kv-cache-memory"
        )
    return num_blocks
