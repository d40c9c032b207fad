"""`EngineConfig`: the engine flags resolved once against a checkpoint and this machine.

`EngineArgs` (engine_args.py) is what the user typed and imports no torch, so `met serve` can
read its flags and start the engine process first; `create_config` resolves them into an
`EngineConfig` (model directory found, dtype and device chosen, KV pool sized), so nothing
downstream reads a flag twice or has to guess a default. The engine process resolves the same
flags the same way (`engine/launch.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from metrale import envs
from metrale.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    is_fp8,
    parse_dtype,
    parse_kv_cache_dtype,
)
from metrale.distributed.launch import Launch
from metrale.engine.speculation.config import SpeculativeConfig
from metrale.engine_args import CPU_PREFILL_TOKENS, GPU_PREFILL_TOKENS, EngineArgs, parse_bytes
from metrale.generation_config import GenerationDefaults
from metrale.layers.attention import resolve_backend

logger = logging.getLogger(__name__)


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
    max_cuda_graph_batch: int = 0  # 0: no CUDA graphs of decode steps
    max_cuda_graph_tokens: int = 0  # 0: steps with prompt tokens run eagerly
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


def create_config(args: EngineArgs, model_dir: Path) -> EngineConfig:
    """`args` resolved against the checkpoint in `model_dir` (`EngineArgs.create_config`)."""
    from metrale import demo

    is_demo = args.is_demo
    model_config = ModelConfig.from_dir(model_dir).with_tensor_parallel(args.tensor_parallel_size)
    dtype = model_config.dtype if args.dtype == "auto" else parse_dtype(args.dtype)
    kv_cache_dtype = parse_kv_cache_dtype(args.kv_cache_dtype, dtype)
    device = _resolve_device(args.device)
    launch = Launch.from_flags(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    _check_ranks(args.tensor_parallel_size, args.data_parallel_size, launch, device)
    if args.quantization == "gguf":
        from metrale.runner.model_loader import weights_format

        if (kind := weights_format(model_dir, args.load_format)) != "gguf":
            raise ValueError(
                f"--quantization gguf keeps a GGUF file's weights packed, and {model_dir} "
                f"loads as {kind}: serve a .gguf file"
            )

    max_seq_len = args.max_seq_len or model_config.max_position_embeddings
    if max_seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings "
            f"({model_config.max_position_embeddings})"
        )
    max_batch_size = min(args.max_batch_size or args.max_num_seqs, args.max_num_seqs)
    max_prefill_tokens = args.max_prefill_tokens or (
        GPU_PREFILL_TOKENS if device.type == "cuda" else CPU_PREFILL_TOKENS
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_batch_size=max_batch_size,
        max_prefill_tokens=max_prefill_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens or max_prefill_tokens + max_batch_size,
        max_seq_len=max_seq_len,
        policy=args.scheduler,
        tbt_deadline_ms=args.tbt_deadline_ms,
        preemption_mode=args.preemption_mode,
    )
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization={args.gpu_memory_utilization} is out of range: "
            f"must be in (0, 1]"
        )
    num_blocks = args.num_kv_blocks
    if num_blocks is None and device.type != "cuda":
        budget = parse_bytes(args.kv_cache_memory)
        num_blocks = _num_blocks_for(budget, model_config, args.block_size, kv_cache_dtype)
    if not (math.isfinite(args.swap_space_gb) and args.swap_space_gb >= 0):
        raise ValueError(f"swap_space_gb={args.swap_space_gb} is out of range: must be >= 0")
    per_block = CacheConfig.bytes_per_block(model_config, args.block_size, kv_cache_dtype)
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        dtype=kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_host_blocks=int(args.swap_space_gb * 2**30 // per_block),
    )
    eager = args.enforce_eager or device.type != "cuda" or args.tensor_parallel_size > 1
    return EngineConfig(
        model_dir=model_dir,
        model_name=demo.MODEL_NAME if is_demo else (args.model or str(model_dir)),
        model=model_config,
        generation=_generation_defaults(model_dir, model_config),
        dtype=dtype,
        device=device,
        load_format=args.load_format,
        quantization=args.quantization,
        seed=args.seed,
        cache=cache,
        scheduler=scheduler,
        chat_template=Path(args.chat_template) if args.chat_template else None,
        is_demo=is_demo,
        tokenizer_eos_token_id=_tokenizer_eos(model_dir, model_config),
        attention_backend=resolve_backend(args.attention_backend, device),
        # (the ranks past 0 do not replay graphs yet: tensor parallelism runs eager)
        max_cuda_graph_batch=0 if eager else args.max_cuda_graph_batch,
        max_cuda_graph_tokens=0 if eager else args.max_cuda_graph_tokens,
        compile_cpu_decode=not args.enforce_eager
        and device.type == "cpu"
        and args.tensor_parallel_size == 1
        and args.quantization is None
        and not is_fp8(kv_cache_dtype)
        and resolve_backend(args.attention_backend, device) == "torch"
        and envs.compile_cpu_decode(),
        async_scheduling=args.scheduler_config == "async"
        or (args.scheduler_config == "auto" and device.type == "cuda"),
        log_stats=not args.disable_log_stats,
        speculative=SpeculativeConfig.parse(
            args.speculative_config,
            args.num_speculative_tokens,
            args.ngram_min,
            args.ngram_max,
            args.shared_lookup,
            args.shared_lookup_entries,
            args.speculation_cost_model,
        ),
        data_parallel_size=args.data_parallel_size,
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
