"""What `/serve-config` shows of a running `met serve`: its settings, where its behaviour came
from, the engine's config and its parallelism, in plain JSON types."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from typing import Any

import msgspec

from metrale.engine.messages import ForwardInfo
from metrale.server.security.config import SecurityConfig


def effective_config(
    args: argparse.Namespace,
    config: Any,
    settings: Any,
    behavior: Any,
    security: SecurityConfig,
    forward: ForwardInfo | None,
) -> dict[str, Any]:
    """What `/serve-config` shows: the server's settings, where its behaviour came from, the
    engine's config and its parallelism, in plain JSON types."""

    def plain(value: Any) -> Any:
        if isinstance(value, msgspec.Struct):
            return msgspec.to_builtins(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, int | float | str | bool) or value is None:
            return value
        return str(value)

    return {
        "server": {
            "bind": args.bind,
            "port": args.port,
            # "uvloop" where installed (serve.py's _event_loop_factory), else "asyncio"
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
            "stream_interval": args.stream_interval,
            "api_server_count": args.api_server_count,
            **plain(settings),
        },
        # where the parsers and the thinking budget came from: a flag, MODEL.toml, a recipe...
        "behavior_sources": {
            "tool_call_parser": behavior.tool_call_parser_source,
            "reasoning_parser": behavior.reasoning_parser_source,
            "max_thinking_budget": behavior.max_thinking_budget_source,
            "content_loop_watchdog": behavior.loop_watchdog_source,
            "max_inter_tool_prose": behavior.max_inter_tool_prose_source,
            "sampling_presets": behavior.sampling_presets_source,
        },
        "response_store": args.response_store,
        "security": security.describe(),  # how many API keys, never the keys
        "engine": plain(config),
        # the engine process's threads, allocator and packed linear layers on a CPU (None on a GPU)
        "cpu_threads": plain(forward.cpu_threads if forward is not None else None),
        "parallelism": {
            "data_parallel_size": config.data_parallel_size,
            "tensor_parallel_size": config.model.tensor_parallel_size,
            "communication_backend": forward.communication_backend if forward else None,
            "rank_devices": forward.rank_devices if forward else [],
        },
    }
