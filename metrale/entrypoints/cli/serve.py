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
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import uvicorn

from metrale.distributed.launch import Launch
from metrale.engine.client import EngineClient, EngineDeadError
from metrale.engine.messages import ForwardInfo
from metrale.engine.spawn import EngineSpec
from metrale.engine.watchdog import DEFAULT_MIN_REPEATS, MIN_SPAN
from metrale.engine_args import EngineArgs
from metrale.entrypoints.cli import Subcommand, register
from metrale.server.security.config import SecurityConfig
from metrale.server.stores import RecordStore, StoreLimits, open_store
from metrale.telemetry.bus import EventBus
from metrale.telemetry.events import Phase
from metrale.telemetry.logs import EventLogHandler

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
def phase(name: str, bus: EventBus) -> Iterator[None]:
    """Run a startup phase: logged with its duration, and told on the bus as it begins and ends."""
    number = PHASES.index(name) + 1
    bus.publish(Phase(index=number, total=len(PHASES), name=name))
    start = time.perf_counter()
    yield
    duration = time.perf_counter() - start
    logger.info("[%2d/%d] %-22s %7.2f s", number, len(PHASES), name, duration)
    bus.publish(Phase(index=number, total=len(PHASES), name=name, duration_s=duration))


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
    g.add_argument("--bind", "--host", default="127.0.0.1", help="address to listen on")
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
        "--content-loop-watchdog",
        choices=["on", "off"],
        help="end a generation whose last tokens repeat one block --content-loop-min-repeats "
        "times (finish_reason stop, stop_reason content_loop); requests may override it with "
        "content_loop_watchdog (default: the checkpoint's MODEL.toml or recipe "
        "[behavior].enable_loop_watchdog, else off)",
    )
    g.add_argument(
        "--max-inter-tool-prose",
        type=int,
        metavar="TOKENS",
        help="end a tool-calling turn whose prose since its last call reaches this many tokens "
        "(finish_reason tool_calls, stop_reason inter_tool_prose); 0: no bound; requests may "
        "set max_inter_tool_prose (default: the checkpoint's MODEL.toml or recipe "
        "[behavior].max_inter_tool_prose, else none)",
    )
    g.add_argument(
        "--content-loop-min-repeats",
        type=int,
        default=DEFAULT_MIN_REPEATS,
        metavar="N",
        help=f"copies of a block that make a loop (a short block must also cover "
        f"{MIN_SPAN} tokens; default {DEFAULT_MIN_REPEATS})",
    )
    g.add_argument(
        "--auto-compact",
        action="store_true",
        help="shorten a chat, messages or responses conversation too long for --max-seq-len "
        "(tool results truncated, then omitted, then the oldest turns dropped, then the system "
        "prompt trimmed, then only the last turn kept) instead of refusing it with a 400; the "
        "x-metrale-compacted header and usage.compacted say so",
    )
    g.add_argument(
        "--disable-thinking",
        action="store_true",
        help="render every prompt with enable_thinking=false (a kill switch)",
    )
    g.add_argument(
        "--response-store",
        default="memory",
        metavar="memory|sqlite:PATH",
        help="where stored responses, conversations and chat completions (store: true) are "
        "kept: in this process, or in a SQLite file that survives restarts",
    )
    g.add_argument(
        "--response-store-max-entries",
        type=int,
        default=StoreLimits.max_entries,
        metavar="N",
        help="records kept at most; past it (or the size cap) the least recently used go",
    )
    g.add_argument(
        "--response-store-max-mb",
        type=float,
        default=StoreLimits.max_bytes / 2**20,
        metavar="MIB",
        help="the stored records' JSON, in MiB, at most",
    )
    g.add_argument(
        "--response-store-ttl",
        type=float,
        default=StoreLimits.ttl_s / 3600,
        metavar="HOURS",
        help="a record not read or written for this long expires (default: 30 days)",
    )
    g.add_argument(
        "--no-access-log",
        action="store_true",
        help="no log line per request (metrale.access); the metrics still count them",
    )
    g.add_argument(
        "--tui",
        action="store_true",
        help="show a live dashboard in this terminal (startup phases, load, latencies, live "
        "requests, logs) instead of log lines; the server keeps serving if it closes",
    )
    g.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="run the engine core in a thread of the server process (debugging)",
    )
    SecurityConfig.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli(args)
    launch = Launch.from_flags(
        engine_args.nnodes, engine_args.node_rank, engine_args.master_addr, engine_args.master_port
    )
    if launch.node_rank > 0:
        return _serve_node(engine_args)
    try:
        with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
            return runner.run(_serve(args))
    except EngineDeadError as e:  # it failed to start (and logged why, where it knew more)
        print(f"met serve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before it served (after, the loop's handler stops it)
        logger.info("interrupted while starting")
        return 130
    except asyncio.CancelledError:  # SIGTERM before it served (`_serve`)
        logger.info("terminated while starting")
        return 128 + signal.SIGTERM


def _serve_node(engine_args: EngineArgs) -> int:
    """A node past 0 (`--node-rank`): run this node's tensor-parallel ranks, which join node 0's
    engine, until they exit (node 0's engine stopped or died); no API here."""
    from metrale.distributed.workers import TensorParallelWorkers

    config = engine_args.create_config()
    launch, size = config.launch, config.model.tensor_parallel_size
    ranks = list(launch.local_ranks(size))
    logger.info(
        "node %d of %d: tensor-parallel ranks %d-%d of %d, meeting node 0 at %s:%d; no API here",
        launch.node_rank,
        launch.nnodes,
        ranks[0],
        ranks[-1],
        size,
        launch.master_addr,
        launch.master_port,
    )
    workers = TensorParallelWorkers.start(config, launch.init_method(), ranks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return workers.wait()
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        workers.kill()


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (uvicorn[standard] brings it on Linux and
    macOS), as `uvicorn.run` would choose; asyncio's own elsewhere. `met serve` runs uvicorn's
    `Server.serve` in a loop of its own making, so the choice is made here."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve(args: argparse.Namespace) -> int:
    # SIGTERM before the server serves (an orchestrator stopping a pod that is still starting)
    # cancels the startup as Ctrl-C does, so the engine process is stopped too; once serving,
    # the server's own handler takes SIGTERM over.
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    engine_args = EngineArgs.from_cli(args)
    security = SecurityConfig.from_cli(args)  # a bad flag stops us before the weights load
    store = _open_store(args)
    bus = EventBus()
    bus.bind_loop()
    root = logging.getLogger()
    log_events = EventLogHandler(bus)
    root.addHandler(log_events)
    dashboard = _start_dashboard(bus, root) if args.tui else None
    try:
        return await _start_and_serve(args, engine_args, security, bus, store)
    finally:
        store.close()
        root.removeHandler(log_events)
        if dashboard is not None:
            dashboard.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dashboard


def _start_dashboard(bus: EventBus, root: logging.Logger) -> asyncio.Task[None]:
    """`--tui`: the dashboard runs in a process of its own, fed from the bus. The console's log
    handlers step aside while it draws (their records reach its log pane through the bus), and
    the engine process writes to a file. Quitting the dashboard stops the server, as Ctrl+C
    does; a terminal that goes away (SIGHUP) ends only the dashboard."""
    from metrale import envs
    from metrale.tui.process import DashboardProcess

    engine_log = envs.cache_dir() / "engine-core.log"
    os.environ["METRALE_ENGINE_LOG_FILE"] = str(engine_log)  # the engine process's output
    logger.info("the engine core logs to %s while the dashboard is up", engine_log)
    console = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
    for handler in console:
        root.removeHandler(handler)
    dashboard = DashboardProcess(bus, "metrale serve")
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, dashboard.kill)

    async def show() -> None:
        try:
            quit_by_user = await dashboard.run()
        finally:
            for handler in console:
                root.addHandler(handler)
        if quit_by_user:
            logger.info("the dashboard was closed: shutting down")
            signal.raise_signal(signal.SIGINT)
        else:
            logger.warning("the dashboard ended (its terminal went away?); still serving")

    return asyncio.create_task(show(), name="dashboard")


async def _start_and_serve(
    args: argparse.Namespace,
    engine_args: EngineArgs,
    security: SecurityConfig,
    bus: EventBus,
    store: RecordStore,
) -> int:
    from metrale import demo

    with phase("resolve model", bus):
        model_dir = engine_args.resolve_model_dir()
        if engine_args.is_demo:
            logger.log(*demo.notice())
    # The engine process starts now: it imports torch and loads the model while this process
    # imports its own torch and server and checks the flags (a process per core with data
    # parallelism, started once the flags are checked).
    early = None
    if engine_args.data_parallel_size == 1:
        early = EngineClient.launch(
            EngineSpec(engine_args, model_dir), in_process=args.engine_in_thread
        )
    try:
        return await _serve_engine(args, engine_args, security, bus, store, model_dir, early)
    finally:
        if early is not None:
            await early.shutdown()


async def _serve_engine(
    args: argparse.Namespace,
    engine_args: EngineArgs,
    security: SecurityConfig,
    bus: EventBus,
    store: RecordStore,
    model_dir: Path,
    early: EngineClient | None,
) -> int:
    from metrale import demo
    from metrale.engine.data_parallel_client import DataParallelClient
    from metrale.engine.stats import communication_backend, rank_devices
    from metrale.frontend.async_llm import AsyncLLM
    from metrale.frontend.parser_selection import behavior_sources, choose_behavior
    from metrale.models import model_class_for
    from metrale.recipes import Behavior, Checkpoint, repo_id_of
    from metrale.runner.model_loader import preflight_model
    from metrale.server.app import build_app
    from metrale.server.security.guard import Guard
    from metrale.server.state import ServerSettings, ServerState
    from metrale.telemetry.hub import Telemetry
    from metrale.telemetry.metrics import Metrics
    from metrale.tokenizer import Tokenizer

    with phase("load config", bus):
        config = engine_args.create_config(model_dir)
        model_class_for(config.model.architecture)  # one we cannot run is named here
        # Read and check the flags, MODEL.toml and recipes now, before waiting on the engine.
        sources = behavior_sources(
            Behavior(
                args.tool_call_parser,
                args.reasoning_parser,
                args.max_thinking_budget,
                enable_loop_watchdog=None
                if args.content_loop_watchdog is None
                else args.content_loop_watchdog == "on",
                max_inter_tool_prose=args.max_inter_tool_prose,
            ),
            model_dir,
            Checkpoint(
                demo.repo_id() if config.is_demo else repo_id_of(config.model_name, model_dir),
                config.model.architecture,
                config.model.model_type,
            ),
        )
    with phase("select kernels", bus):
        if config.attention_backend == "triton":
            graphs = config.max_cuda_graph_batch
            logger.info(
                "attention backend: triton (paged kernels); %s",
                f"CUDA graphs up to batch {graphs}" if graphs else "eager, no CUDA graphs",
            )
        else:
            logger.info("attention backend: torch (scaled_dot_product_attention over paged KV)")
    with phase("backend", bus):
        logger.info("device %s, dtype %s", config.device, str(config.dtype).removeprefix("torch."))
    with phase("communication backend", bus):
        if config.data_parallel_size > 1:
            logger.info(
                "data parallelism: %d engine cores, requests routed by prefix affinity, then load",
                config.data_parallel_size,
            )
        if (size := config.model.tensor_parallel_size) == 1:
            logger.info("single rank: no tensor parallelism")
        else:
            logger.info(
                "tensor parallelism: world size %d, %s, devices %s (rank 0: the engine process)",
                size,
                communication_backend(config.device, size),
                ", ".join(rank_devices(config)),
            )
    with phase("preflight and weights", bus):
        preflight_model(model_dir, config.load_format)
        if early is not None:
            await early.ready(config)
            client = early
        else:
            client = await DataParallelClient.start(config, in_process=args.engine_in_thread)
        config = client.config  # with the KV pool size the engine settled on
    try:
        with phase("tokenizer and template", bus):
            tokenizer = Tokenizer.from_dir(
                model_dir,
                chat_template_path=config.chat_template,
                model_type=config.model.model_type,
            )
            template_text = "\n".join(t.text for t in tokenizer.chat_template.sources.values())
            behavior = choose_behavior(sources, template_text)
            logger.info("%s", behavior.describe())
        with phase("scheduler", bus):
            name = args.served_model_name or (
                demo.MODEL_NAME if engine_args.is_demo else engine_args.model or str(model_dir)
            )
            metrics = Metrics(name, config.scheduler.max_seq_len) if config.log_stats else None
            llm = AsyncLLM(client, tokenizer, Telemetry(metrics, bus))
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
        with phase("router", bus):
            settings = ServerSettings(
                served_model_name=name,
                request_timeout_s=args.request_timeout,
                always_include_usage=args.always_include_usage,
                tool_call_parser=behavior.tool_call_parser,
                reasoning_parser=behavior.reasoning_parser,
                reasoning_field=args.reasoning_field,
                max_thinking_budget=behavior.max_thinking_budget,
                content_loop_watchdog=behavior.loop_watchdog,
                content_loop_min_repeats=args.content_loop_min_repeats,
                max_inter_tool_prose=behavior.max_inter_tool_prose,
                sampling_presets=behavior.sampling_presets,
                disable_thinking=args.disable_thinking,
                auto_compact=args.auto_compact,
                access_log=not args.no_access_log,
            )
            state = ServerState(
                llm,
                tokenizer,
                config,
                settings,
                serve_config=_effective_config(
                    args, config, settings, behavior, security, llm.client.forward
                ),
                guard=Guard(security),
                store=store,
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

        bus.publish(Phase(index=len(PHASES), total=len(PHASES), name="listening"))

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            duration = time.perf_counter() - listening_start
            logger.info("[%2d/%d] %-22s %7.2f s", len(PHASES), len(PHASES), "listening", duration)
            bus.publish(
                Phase(index=len(PHASES), total=len(PHASES), name="listening", duration_s=duration)
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


def _open_store(args: argparse.Namespace) -> RecordStore:
    try:
        limits = StoreLimits(
            max_entries=args.response_store_max_entries,
            max_bytes=int(args.response_store_max_mb * 2**20),
            ttl_s=args.response_store_ttl * 3600,
        )
        store = open_store(args.response_store, limits)
    except ValueError as e:
        raise SystemExit(f"met serve: --response-store: {e}") from None
    logger.info("response store: %s (%d records kept)", args.response_store, len(store))
    return store


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
    forward: ForwardInfo | None,
) -> dict[str, Any]:
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
            # "uvloop" where installed (see _event_loop_factory), else "asyncio"
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
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
        # the engine process's threads, allocator and oneDNN layers on a CPU (None on a GPU)
        "cpu_threads": plain(forward.cpu_threads if forward is not None else None),
        "parallelism": {
            "data_parallel_size": config.data_parallel_size,
            "tensor_parallel_size": config.model.tensor_parallel_size,
            "communication_backend": forward.communication_backend if forward else None,
            "rank_devices": forward.rank_devices if forward else [],
        },
    }


register(
    Subcommand(
        "serve", "serve a model over OpenAI- and Anthropic-compatible HTTP", add_arguments, run
    )
)
