"""The engine's state as `/memory` reports it: the KV pool, the requests, the device memory."""

from __future__ import annotations

import torch

from metrale.engine.core import EngineCore
from metrale.engine.messages import DeviceMemory, KVCacheStats


def kv_cache_stats(core: EngineCore) -> KVCacheStats:
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
        memory=device_memory(core),
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
