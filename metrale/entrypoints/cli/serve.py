"""`met serve [MODEL]`: the OpenAI- and Anthropic-compatible HTTP server.

Startup runs in named phases, each logged with its duration. The engine core loads the weights
in a process of its own; this process serves HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from metrale.distributed.launch import Launch
from metrale.engine.client import EngineClient, EngineDeadError
from metrale.engine.spawn import EngineSpec
from metrale.engine.watchdog import DEFAULT_MIN_REPEATS, MIN_SPAN
from metrale.engine_args import EngineArgs
from metrale.entrypoints.cli import Subcommand, register
from metrale.entrypoints.cli.api_processes import check_api_server_count, listening_socket
from metrale.entrypoints.cli.startup import Startup, phase
from metrale.server.security.config import SecurityConfig
from metrale.server.stores import RecordStore, StoreLimits, open_store
from metrale.telemetry.bus import EventBus
from metrale.telemetry.logs import EventLogHandler

logger = logging.getLogger("metrale.serve")


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
        "--stream-interval",
        type=_at_least_one,
        default=1,
        metavar="TOKENS",
        help="stream a request's tokens in events of this many (the first token and the last "
        "go at once): fewer, larger events cost the server less per token at high concurrency "
        "(default 1: an event per token, or per engine step's tokens)",
    )
    g.add_argument(
        "--api-server-count",
        type=_at_least_one,
        default=1,
        metavar="N",
        help="API processes serving the one engine on the same port (each detokenizes and "
        "streams the connections it accepts): more than one where a single process cannot "
        "keep up with the engine (hundreds of concurrent streams on a fast GPU; with "
        "--data-parallel-size, each routes its requests over the cores; the rate limits, the "
        "queue bound and the record store are the server's) (default 1)",
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


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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
    check_api_server_count(args)
    per_run_store = _share_memory_store(args)
    store = open_record_store(args)
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
        if per_run_store is not None:
            shutil.rmtree(per_run_store, ignore_errors=True)
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
    logger.info(
        "the engine core (and any other API process) logs to %s while the dashboard is up",
        engine_log,
    )
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
    count = args.api_server_count
    listener = listening_socket(args.bind, args.port) if count > 1 else None
    # The engine process starts now: it imports torch and loads the model while this process
    # imports its own torch and server and checks the flags (a process per core with data
    # parallelism, started once the flags are checked); the other API processes with it.
    early = None
    if engine_args.data_parallel_size == 1:
        spec = EngineSpec(engine_args, model_dir)
        if count == 1:  # (its own keywords only: tests stand in for it)
            early = EngineClient.launch(spec, in_process=args.engine_in_thread)
        else:
            early = EngineClient.launch(spec, api_server_count=count)
    try:
        startup = Startup(args, engine_args, security, bus, store, model_dir)
        return await startup.run(early, listener=listener)
    finally:
        if early is not None:
            await early.shutdown()
        if listener is not None:
            listener.close()


def _share_memory_store(args: argparse.Namespace) -> Path | None:
    """Several API processes share one store: for `--response-store memory`, a SQLite file of
    this run's (its directory, removed when the server stops; None with one process)."""
    if args.api_server_count == 1 or args.response_store != "memory":
        return None
    directory = Path(tempfile.mkdtemp(prefix="metrale-store-"))
    args.response_store = f"sqlite:{directory / 'records.db'}"
    logger.info("response store: this run's, shared by the API processes")
    return directory


def open_record_store(args: argparse.Namespace) -> RecordStore:
    try:
        limits = StoreLimits(
            max_entries=args.response_store_max_entries,
            max_bytes=int(args.response_store_max_mb * 2**20),
            ttl_s=args.response_store_ttl * 3600,
        )
        store = open_store(args.response_store, limits, shared=args.api_server_count > 1)
    except ValueError as e:
        raise SystemExit(f"met serve: --response-store: {e}") from None
    logger.info("response store: %s (%d records kept)", args.response_store, len(store))
    return store


register(
    Subcommand(
        "serve", "serve a model over OpenAI- and Anthropic-compatible HTTP", add_arguments, run
    )
)
