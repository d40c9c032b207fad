"""The engine's reports of itself: its state as `/memory` reports it (the KV pool, the requests,
the device memory) and its forward as `/forward` describes it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from metrale.engine.allocator import preloaded_allocator
from metrale.engine.core import EngineCore
from metrale.engine.messages import CPUThreads, DeviceMemory, ForwardInfo, KVCacheStats
from metrale.engine_config import EngineConfig

# What runs each part of a decoder layer, by attention backend (see docs/architecture.md).
_KERNELS = {
    "triton": {
        "attention.decode": "triton paged_decode_attention (split-K over the context, GQA-aware)",
        "attention.prefill": "triton paged_prefill_attention (varlen, over the paged KV)",
        "rotary_and_kv_store": "triton rotary_kv_store (k rotated into the cache)",
        "rms_norm": "triton rms_norm (fused residual add)",
        "silu_and_mul": "triton silu_and_mul",
        "linear": "torch matmul; one-row steps: triton gemv",
        "mlp.down_proj": "torch matmul; one-row steps: triton gemv with silu_and_mul fused",
    },
    "torch": {
        "attention": "torch scaled_dot_product_attention over the gathered paged KV",
        "rotary_and_kv_store": "torch",
        "rms_norm": "torch (fp32)",
        "silu_and_mul": "torch",
        "linear": "torch matmul",
    },
}


def kv_cache_stats(core: EngineCore, memory: DeviceMemory | None = None) -> KVCacheStats:
    """The pool and the requests as they are now; the device's memory as `memory` read it, or
    read now."""
    scheduler = core.scheduler
    pool = scheduler.kv_cache.pool
    cache = core.config.cache
    return KVCacheStats(
        num_blocks=pool.num_blocks,
        num_used_blocks=pool.num_used_blocks,
        num_cached_blocks=pool.num_cached_blocks,
        block_size=cache.block_size,
        bytes_per_block=cache.bytes_per_block(core.config.model, cache.block_size, cache.dtype),
        num_prefix_queried_tokens=scheduler.kv_cache.stats.num_queried_tokens,
        num_prefix_hit_tokens=scheduler.kv_cache.stats.num_hit_tokens,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preemptions=scheduler.num_preemptions,
        memory=device_memory(core) if memory is None else memory,
        num_recomputed_tokens=scheduler.num_recomputed_tokens,
        swap=None if scheduler.swap is None else scheduler.swap.stats(),
        spec_decode=None if scheduler.speculator is None else scheduler.speculator.stats,
    )


def device_memory(core: EngineCore) -> DeviceMemory:
    device = core.config.device
    if device.type != "cuda":
        return DeviceMemory(str(device))
    free, total = torch.cuda.mem_get_info(device)  # a driver query: no sync with the stream
    return DeviceMemory(
        str(device),
        total_bytes=total,
        used_bytes=total - free,
        allocated_bytes=torch.cuda.memory_allocated(device),
        budget_bytes=int(total * core.config.cache.gpu_memory_utilization),
    )


class DeviceMemoryReader:
    """`device_memory` for the reports sent after every step, asked of the driver at most once
    every `period_s`: asked each step it cost the step's host ~76 us on an H100's host (torch's
    `memory_allocated` 70 us, the driver's `mem_get_info` 6 us), and what it reads moves only
    when memory is taken or given back on the device, which `/memory` and the metrics show a
    second late at most."""

    def __init__(
        self, core: EngineCore, period_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.core = core
        self.period_s = period_s
        self.clock = clock
        self._memory: DeviceMemory | None = None
        self._read_at = 0.0

    def read(self) -> DeviceMemory:
        now = self.clock()
        if self._memory is None or now - self._read_at >= self.period_s:
            self._memory, self._read_at = device_memory(self.core), now
        return self._memory


def forward_info(core: EngineCore) -> ForwardInfo:
    config, model = core.config, core.config.model
    backend = config.attention_backend
    graphs = core.runner.graphs
    piecewise = core.runner.piecewise
    cuda = config.device.type == "cuda"

    def name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    return ForwardInfo(
        architecture=model.architecture,
        model_type=model.model_type,
        dtype=name(config.dtype),
        device=str(config.device),
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        vocab_size=model.vocab_size,
        max_seq_len=config.scheduler.max_seq_len,
        sliding_window=model.sliding_window,
        attention_backend=backend,
        kernels=_kernels(core),
        programmatic_dependent_launch=cuda and backend == "triton" and _pdl(config.device),
        cuda_graph_batch_sizes=sorted(graphs.graphs) if graphs is not None else [],
        cuda_graph_token_counts=sorted(piecewise.graphs) if piecewise is not None else [],
        compiled_decode=core.runner.compiled is not None,
        kv_cache_dtype=name(config.cache.dtype),
        kv_block_size=config.cache.block_size,
        num_kv_blocks=core.scheduler.kv_cache.pool.num_blocks,
        async_scheduling=config.async_scheduling,
        tensor_parallel_size=model.tensor_parallel_size,
        data_parallel_size=config.data_parallel_size,
        communication_backend=communication_backend(config.device, model.tensor_parallel_size),
        rank_devices=rank_devices(config),
        num_heads_per_rank=model.num_heads_per_rank,
        num_kv_heads_per_rank=model.num_kv_heads_per_rank,
        quantization=_quantization(core),
        cpu_threads=None if cuda else cpu_threads(core.runner.model),
    )


def communication_backend(device: torch.device, tensor_parallel_size: int) -> str | None:
    """torch.distributed's backend for the ranks (None: one rank, no group)."""
    if tensor_parallel_size == 1:
        return None
    return "nccl" if device.type == "cuda" else "gloo"


def rank_devices(config: EngineConfig) -> list[str]:
    """Each rank's device: `node<n>:` before those of other nodes than this one."""
    from metrale.distributed.workers import rank_device

    size = config.model.tensor_parallel_size
    here = config.launch.local_ranks(size)
    return [
        str(rank_device(config, r))
        if r in here
        else f"node{r // len(here)}:{rank_device(config, r)}"
        for r in range(size)
    ]


def cpu_threads(model: torch.nn.Module) -> CPUThreads:
    """This process's CPU threads, its allocator and its packed linear layers."""
    from metrale.layers.linear import Linear

    return CPUThreads(
        cores_usable=len(os.sched_getaffinity(0)),
        torch_threads=torch.get_num_threads(),
        torch_interop_threads=torch.get_num_interop_threads(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        allocator=preloaded_allocator(),
        onednn_linear_layers=sum(
            1 for m in model.modules() if isinstance(m, Linear) and m.onednn is not None
        ),
        panel_linear_layers=sum(
            1 for m in model.modules() if isinstance(m, Linear) and m.panels is not None
        ),
    )


def _kernels(core: EngineCore) -> dict[str, str]:
    """What runs each part of a layer (`_KERNELS`), with what a CPU runs in the torch backend's
    place: the packed products (Metrale's panels or oneDNN's), Metrale's C++ decode attention, the
    compiled decode steps."""
    kernels = dict(_KERNELS.get(core.config.attention_backend, {}))
    if core.config.device.type != "cpu" or core.config.attention_backend != "torch":
        return kernels
    from metrale.kernels import cpu_extension
    from metrale.layers.linear import Linear

    if cpu_extension.attends_in_place(core.config.cache.dtype, core.config.model.head_dim):
        kernels["attention"] = (
            "decode rows: metrale_cpu paged_decode_attention over the paged KV in place; "
            "prompt chunks: torch scaled_dot_product_attention over the gathered paged KV"
        )
    layers = [m for m in core.runner.model.modules() if isinstance(m, Linear)]
    if any(m.panels is not None for m in layers):
        kernels["linear"] = "metrale_cpu panel_linear, float32 weights packed in column panels"
    elif any(m.onednn is not None for m in layers):
        kernels["linear"] = "oneDNN, weights prepacked in its layout"
    if core.runner.compiled is not None:
        packed = sum(m.decode_packed is not None for m in layers)
        kernels["linear"] += (
            f"; compiled one-row steps: metrale_cpu packed_gemv over the GGUF file's blocks "
            f"({packed} of {len(layers)} layers), inductor's streamed reduction elsewhere"
            if packed
            else "; compiled one-row steps: inductor's streamed reduction over the dense weight"
        ) + "; compiled steps of several rows: the packed product, called from the graph"
    return kernels


def _quantization(core: EngineCore) -> str | None:
    """What --quantization made of the model's linear layers, e.g. "gguf: 120 linear layers
    packed (Q4_1 x120), 0 dequantized"."""
    if core.config.quantization is None:
        return None
    from collections import Counter

    from metrale.layers.linear import Linear

    layers = [m for m in core.runner.model.modules() if isinstance(m, Linear)]
    formats = Counter(m.packed.fmt for m in layers if m.packed is not None)
    packed = sum(formats.values())
    kinds = ", ".join(f"{fmt} x{n}" for fmt, n in sorted(formats.items()))
    return (
        f"{core.config.quantization}: {packed} linear layers packed ({kinds}), "
        f"{len(layers) - packed} dequantized"
    )


def _pdl(device: torch.device) -> bool:
    from metrale.kernels.pdl import pdl_enabled  # imports triton: only where it runs

    return pdl_enabled(device)
