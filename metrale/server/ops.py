"""Operational routes: health, the effective configuration, the hardware, the KV pool."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request

from metrale.engine.messages import KVCacheStats
from metrale.engine.swap_space import SwapStats
from metrale.hardware import describe
from metrale.server.json_body import JSONResponse
from metrale.server.state import ServerState

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Ready: the engine core is alive and serving."""
    state: ServerState = request.app.state.server
    if not state.llm.is_alive:
        return JSONResponse(
            {"status": "unavailable", "reason": state.llm.client.dead_reason}, status_code=503
        )
    return JSONResponse({"status": "ok"})


@router.get("/health/live")
async def live() -> dict[str, str]:
    """Live: the API process answers (says nothing of the engine)."""
    return {"status": "ok"}


@router.get("/serve-config")
async def serve_config(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    return state.serve_config


@router.get("/memory")
async def memory(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    client = state.llm.client
    if client.kv_cache is None:
        return {"kv_cache": None}
    figures = memory_figures(client.kv_cache)
    if (engines := getattr(client, "kv_caches", None)) is not None:  # data parallelism
        figures["engines"] = [None if kv is None else memory_figures(kv) for kv in engines]
    return figures


def memory_figures(kv: KVCacheStats) -> dict[str, Any]:
    """One pool's blocks and requests, as /memory shows them."""
    return {
        "kv_cache": {
            "block_size": kv.block_size,
            "blocks_total": kv.num_blocks,
            "blocks_used": kv.num_used_blocks,
            "blocks_cached": kv.num_cached_blocks,
            "bytes_per_block": kv.bytes_per_block,
            "bytes_total": kv.num_blocks * kv.bytes_per_block,
            "bytes_used": kv.num_used_blocks * kv.bytes_per_block,
            "usage": kv.usage,
        },
        "requests": {
            "running": kv.num_running,
            "waiting": kv.num_waiting,
            "preemptions": kv.num_preemptions,
            "recomputed_tokens": kv.num_recomputed_tokens,
        },
        "swap": None if kv.swap is None else swap_figures(kv.swap),
        "prefix_cache": {
            "queried_tokens": kv.num_prefix_queried_tokens,
            "hit_tokens": kv.num_prefix_hit_tokens,
        },
        "device": None if kv.memory is None else msgspec.structs.asdict(kv.memory),
    }


def swap_figures(swap: SwapStats) -> dict[str, Any]:
    """The host pool of --swap-space-gb and what has moved through it."""
    return {
        "blocks_total": swap.num_blocks,
        "blocks_used": swap.num_used_blocks,
        "bytes_per_block": swap.bytes_per_block,
        "bytes_total": swap.num_blocks * swap.bytes_per_block,
        "bytes_used": swap.num_used_blocks * swap.bytes_per_block,
        "requests_swapped": swap.num_swapped_requests,
        "swap_outs": swap.num_swap_outs,
        "blocks_out": swap.blocks_out,
        "blocks_in": swap.blocks_in,
        "bytes_out": swap.blocks_out * swap.bytes_per_block,
        "bytes_in": swap.blocks_in * swap.bytes_per_block,
        "copy_seconds": swap.copy_s,
        "measured_copy_bytes_per_s": swap.copy_bytes_per_s,
        "measured_prefill_seconds_per_token": swap.prefill_s_per_token,
    }


@router.get("/hardware")
async def hardware() -> dict[str, Any]:
    return describe()
