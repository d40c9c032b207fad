"""Size the KV pool of a GPU from a profiling forward at the largest step."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from metrale.config import CacheConfig
from metrale.distributed.parallel_state import tp_rank
from metrale.distributed.step_message import receive_step
from metrale.engine_config import EngineConfig

logger = logging.getLogger(__name__)


def kv_blocks_for_gpu(model: nn.Module, config: EngineConfig) -> int:
    """Blocks that fit in `gpu_memory_utilization` of the device once the weights, the CUDA
    context and the activation peak of the largest step (`max_num_batched_tokens`) are paid."""
    from metrale.runner.model_runner import ModelRunner
    from metrale.runner.probe_steps import prefill_probe

    device, cache, scheduler = config.device, config.cache, config.scheduler
    num_tokens = min(scheduler.max_num_batched_tokens, scheduler.max_seq_len)
    probe_blocks = -(-num_tokens // cache.block_size)
    probe = ModelRunner(
        model,
        config.model,
        dataclasses.replace(cache, num_blocks=probe_blocks, num_host_blocks=0),
        scheduler,
        device,
        config.attention_backend,
    )
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    allocated_before = torch.cuda.memory_allocated(device)
    if tp_rank() == 0:
        probe.execute(prefill_probe(num_tokens, cache.block_size))
    else:  # the same step, as rank 0 sends it (every rank profiles together)
        probe.follow(receive_step(device, cache.block_size, config.model.sliding_window))
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - allocated_before
    del probe
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = total * cache.gpu_memory_utilization - used - activation_peak
    per_block = CacheConfig.bytes_per_block(config.model, cache.block_size, cache.dtype)
    num_blocks = int(budget // per_block)
    logger.info(
        "GPU memory: %.1f GiB total, %.1f GiB in use (weights, context), activation peak "
        "%.2f GiB at %d tokens; KV pool %d blocks (%.1f GiB) at utilization %.2f",
        total / 2**30,
        used / 2**30,
        activation_peak / 2**30,
        num_tokens,
        num_blocks,
        num_blocks * per_block / 2**30,
        cache.gpu_memory_utilization,
    )
    if num_blocks < 1:
        raise ValueError(
            f"no GPU memory is left for the KV cache ({budget / 2**30:.1f} GiB after weights "
            f"and activations): raise --gpu-memory-utilization or lower "
            f"--max-num-batched-tokens"
        )
    return num_blocks
