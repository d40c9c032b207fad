"""`met serve [MODEL]`: the OpenAI- and Anthropic-compatible HTTP server.

Startup runs in named phases, each logged with its duration. The engine core loads the weights
in a process of its own; this process serves HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from metrale.engine_args import EngineArgs
from metrale.entrypoints.cli import Subcommand, register
from metrale.server.security.config import SecurityConfig

logger = logging.getLogger("metrale.serve")

PHASES = (
    "resolve model",
    "load config",
    "select kernels",
    "backend",
    "communication backend",
    "preflight and weights",
    "tokenizer and template",
    "scheduler",
    "router",
    "listening",
)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    number = PHASES.index(name) + 1
    start = time.perf_counter()
    yield
    logger.info("[%2d/%d] %-22s %7.2f s", number, len(PHASES), name, time.perf_counter() - start)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        help="a Hugging Face id or a checkpoint directory "
        "(default: the built-in demo model, offline)",
    )
    g = parser.add_argument_group("server")
    g.add_argument(
        "--served-model-name",
        help="the model name clients use (default: MODEL as given, or metrale-demo)",
    )
    g.add_argument("--bind", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument(
        "--request-timeout",
        type=float,
        metavar="SECONDS",
        help="end any request that runs longer than this (default: no limit)",
    )
    g.add_argument(
        "--always-include-usage",
        action="store_true",
        help="add a usage chunk to every stream, as if stream_options.include_usage",
    )
    g.add_argument(
        "--tool-call-parser",
        help="how tool calls appear in the model's output: hermes, qwen3_coder, qwen3_xml, "
        "gemma4, mistral, minimax_xml, bare_json, poolside_v1, auto (from the chat template) or "
        "none (default: the checkpoint's MODEL.toml, else a recipe in metrale/recipes/, else by "
        "model type, else auto)",
    )
    g.add_argument(
        "--reasoning-parser",
        help="split <think> blocks into reasoning_content: qwen3, deepseek_r1 or none "
        "(default: the checkpoint's MODEL.toml, else a recipe, else by model type)",
    )
    g.add_argument(
        "--reasoning-field",
        default="reasoning_content",
        choices=["reasoning_content", "reasoning", "both"],
        help="the message field that carries the reasoning",
    )
    g.add_argument(
        "--max-thinking-budget",
        type=int,
        metavar="TOKENS",
        help="close a thinking block by forcing </think> once it has this many tokens "
        "(requests can ask for less with reasoning_effort; default: the checkpoint's MODEL.toml "
        "or recipe [behavior].max_thinking_budget, else none)",
    )
    g.add_argument(
        "--disable-thinking",
        action="store_true",
        help="render every prompt with enable_thinking=false (a kill switch)",
    )
    g.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="run the engine core in a thread of the server process (debugging)",
    )
    SecurityConfig.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from metrale import demo
    from metrale.checkpoint.weights import preflight
    from metrale.config import ModelConfig
    from metrale.engine.client import EngineClient
    from metrale.frontend.async_llm import AsyncLLM
    from metrale.frontend.parser_selection import behavior_sources, choose_behavior
    from metrale.models import model_class_for
    from metrale.recipes import Behavior, Checkpoint, repo_id_of
    from metrale.server.app import build_app
    from metrale.server.security.guard import Guard
    from metrale.server.state import ServerSettings, ServerState
    from metrale.tokenizer import Tokenizer

    engine_args = EngineArgs.from_cli(args)
    security = SecurityConfig.from_cli(args)  # a bad flag stops us before the weights load
    with phase("resolve model"):
        model_dir = engine_args.resolve_model_dir()
        if engine_args.is_demo:
            logger.warning(demo.WEIGHTS_NOTICE)
    with phase("load config"):
        config = engine_args.create_config(model_dir)
        model_cls = model_class_for(config.model.architecture)
        # Read and check the flags, MODEL.toml and recipes now, before the weights load.
        sources = behavior_sources(
            Behavior(args.tool_call_parser, args.reasoning_parser, args.max_thinking_budget),
            model_dir,
            Checkpoint(
                repo_id_of(config.model_name, model_dir),
                config.model.architecture,
                config.model.model_type,
            ),
        )
    with phase("select kernels"):
        if config.attention_backend == "triton":
            graphs = config.max_cuda_graph_batch
            logger.info(
                "attention backend: triton (paged kernels); %s",
                f"CUDA graphs up to batch {graphs}" if graphs else "eager, no CUDA graphs",
            )
        else:
            logger.info("attention backend: torch (scaled_dot_product_attention over paged KV)")
    with phase("backend"):
        logger.info("device %s, dtype %s", config.device, str(config.dtype).removeprefix("torch."))
    with phase("communication backend"):
        logger.info("single rank: no tensor parallelism")
    with phase("preflight and weights"):
        if config.load_format == "safetensors":
            preflight(model_dir, model_cls.checkpoint_shapes(ModelConfig.from_dir(model_dir)))
        client = await EngineClient.start(config, in_process=args.engine_in_thread)
        config = client.config  # with the KV pool size the engine settled on
    try:
        with phase("tokenizer and template"):
            tokenizer = Tokenizer.from_dir(
                model_dir,
                chat_template_path=config.chat_template,
                model_type=config.model.model_type,
            )
            template_text = "\n".join(t.text for t in tokenizer.chat_template.sources.values())
            behavior = choose_behavior(sources, template_text)
            logger.info("%s", behavior.describe())
        with phase("scheduler"):
            llm = AsyncLLM(client, tokenizer)
            llm.start()
            assert client.kv_cache is not None
            logger.info(
                "KV pool: %d blocks of %d tokens (%s); max_seq_len %d, max_num_seqs %d",
                client.kv_cache.num_blocks,
                config.cache.block_size,
                str(config.cache.dtype).removeprefix("torch."),
                config.scheduler.max_seq_len,
                config.scheduler.max_num_seqs,
            )
        with phase("router"):
            name = args.served_model_name or (
                demo.MODEL_NAME if engine_args.is_demo else engine_args.model or str(model_dir)
            )
            settings = ServerSettings(
                served_model_name=name,
                request_timeout_s=args.request_timeout,
                always_include_usage=args.always_include_usage,
                tool_call_parser=behavior.tool_call_parser,
                reasoning_parser=behavior.reasoning_parser,
                reasoning_field=args.reasoning_field,
                max_thinking_budget=behavior.max_thinking_budget,
                disable_thinking=args.disable_thinking,
            )
            state = ServerState(
                llm,
                tokenizer,
                config,
                settings,
                serve_config=_effective_config(args, config, settings, behavior, security),
                guard=Guard(security),
            )
            if security.api_keys:
                logger.info(
                    "API keys: %d; required on %s",
                    len(security.api_keys),
                    "every route but /health" if security.require_auth else "/v1 routes",
                )
            app = build_app(state)
        server = _Server(
            uvicorn.Config(
                app,
                host=args.bind,
                port=args.port,
                log_level="warning",
                timeout_graceful_shutdown=5,
                lifespan="off",
            )
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.handle_exit, sig, None)
        listening_start = time.perf_counter()

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            logger.info(
                "[%2d/%d] %-22s %7.2f s",
                len(PHASES),
                len(PHASES),
                "listening",
                time.perf_counter() - listening_start,
            )
            logger.info("serving %s on http://%s:%d", name, args.bind, args.port)

        announcer = asyncio.create_task(announce())
        await server.serve()
        announcer.cancel()
    finally:
        logger.info("shutting down")
        if "llm" in locals():
            await llm.shutdown()
        else:
            await client.shutdown()
    return 0


class _Server(uvicorn.Server):
    """uvicorn re-raises a caught SIGTERM after its shutdown, killing the process before the
    engine core is stopped; `met serve` owns the signals instead and exits 0 once all is down."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _effective_config(
    args: argparse.Namespace,
    config: Any,
    settings: Any,
    behavior: Any,
    security: SecurityConfig,
) -> dict[str, Any]:
    def plain(value: Any) -> Any:
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
        "server": {"bind": args.bind, "port": args.port, **plain(settings)},
        # where the parsers and the thinking budget came from: a flag, MODEL.toml, a recipe...
        "behavior_sources": {
            "tool_call_parser": behavior.tool_call_parser_source,
            "reasoning_parser": behavior.reasoning_parser_source,
            "max_thinking_budget": behavior.max_thinking_budget_source,
        },
        "security": security.describe(),  # how many API keys, never the keys
        "engine": plain(config),
    }


register(
    Subcommand(
        "serve", "serve a model over OpenAI- and Anthropic-compatible HTTP", add_arguments, run
    )
)
