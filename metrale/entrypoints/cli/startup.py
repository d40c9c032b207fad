"""`met serve`'s startup on node 0, phase by phase: each phase logged with its duration and told
on the event bus as it begins and ends (the dashboard and `/v1/events` show them).

The engine process was launched before this (`serve.py`): these phases read and check the
flags, the checkpoint's recipe and the tokenizer while it loads the weights, then wait for it,
build the server around it and serve until a signal stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from metrale.engine.client import EngineClient
from metrale.engine.heap import freeze_startup_heap
from metrale.engine_args import EngineArgs
from metrale.entrypoints.cli.serve_config import effective_config
from metrale.server.security.config import SecurityConfig
from metrale.server.stores import RecordStore
from metrale.telemetry.bus import EventBus
from metrale.telemetry.events import Phase

if TYPE_CHECKING:
    from fastapi import FastAPI

    from metrale.engine.data_parallel_client import DataParallelClient
    from metrale.engine_config import EngineConfig
    from metrale.entrypoints.cli.api_processes import ApiProcesses
    from metrale.frontend.async_llm import AsyncLLM
    from metrale.frontend.parser_selection import BehaviorChoice, Source
    from metrale.server.openai.responses.background_peers import BackgroundPeers
    from metrale.server.security.shared_admission import SharedAdmission
    from metrale.server.state import ServerSettings
    from metrale.telemetry.event_peers import EventPeers
    from metrale.telemetry.metrics_peers import MetricsPeers
    from metrale.tokenizer import Tokenizer

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
    _finished(number, name, time.perf_counter() - start, bus)


def _finished(number: int, name: str, duration: float, bus: EventBus) -> None:
    logger.info("[%2d/%d] %-22s %7.2f s", number, len(PHASES), name, duration)
    bus.publish(Phase(index=number, total=len(PHASES), name=name, duration_s=duration))


class Startup:
    """The phases after the model is resolved, for one `met serve` on node 0. `early`: the
    engine process launched already (one core), else None (data parallelism: the cores start
    once the flags are checked, in "preflight and weights")."""

    def __init__(
        self,
        args: argparse.Namespace,
        engine_args: EngineArgs,
        security: SecurityConfig,
        bus: EventBus,
        store: RecordStore,
        model_dir: Path,
        api_process: int = 0,
        admission: SharedAdmission | None = None,
    ) -> None:
        self.args = args
        self.api_process = api_process  # which of `--api-server-count`'s processes this is
        self.listener: socket.socket | None = None  # bound already, with several
        self.extras: ApiProcesses | None = None  # the others, the first's to start and stop
        # links to the others' telemetry and background responses
        self.peers: list[MetricsPeers | EventPeers | BackgroundPeers] = []
        # The admission rules' state the API processes share (the first makes it).
        self.admission = admission
        self.engine_args = engine_args
        self.security = security
        self.bus = bus
        self.store = store
        self.model_dir = model_dir

    async def run(
        self,
        early: EngineClient | list[EngineClient] | None,
        *,
        listener: socket.socket | None = None,
        on_serving: Callable[[], None] | None = None,
    ) -> int:
        """Start up and serve until stopped; 0, or 1 when another API process died. `early`:
        the engine launched, or none yet (data parallelism: the cores start once the flags are
        checked); past the first API process, the engine or the cores attached to. `listener`:
        the socket bound already (several API processes): the first starts the others as soon
        as the engine is launched, and stops them before it."""
        self.listener = listener
        owns_admission = listener is not None and self.api_process == 0
        if owns_admission:
            from metrale.server.security.shared_admission import SharedAdmission

            self.admission = SharedAdmission.create(self.args.api_server_count)
        try:
            return await self._run(early, on_serving)
        finally:
            if self.extras is not None:
                await self.extras.stop()
            if owns_admission and self.admission is not None:
                self.admission.remove()

    async def _run(
        self,
        early: EngineClient | list[EngineClient] | None,
        on_serving: Callable[[], None] | None,
    ) -> int:
        _import_server()  # while the engine loads the model, not after it is ready
        if isinstance(early, EngineClient):
            self.start_other_api_processes([early])
        config, sources = self.load_config()
        self.describe(config)
        client = await self.start_engine(config, early)
        config = client.config  # with the KV pool size the engine settled on
        llm = None
        failed = False
        try:
            tokenizer, behavior = self.tokenizer_and_behavior(config, sources)
            llm = self.engine_frontend(client, config, tokenizer)
            app = self.server_app(llm, config, tokenizer, behavior)
            failed = await self.serve(app, on_serving)
        finally:
            logger.info("shutting down")
            if self.extras is not None:
                await self.extras.stop()  # before the engine they stream from
            for peers in self.peers:
                await peers.close()
            await (llm.shutdown() if llm is not None else client.shutdown())
        return 1 if failed else 0

    def start_other_api_processes(self, engines: list[EngineClient]) -> None:
        """With `--api-server-count` above 1, the first API process starts the others once
        the engine (every core of it) is launched, so that they start while it loads."""
        from metrale.entrypoints.cli.api_processes import ApiProcesses

        if self.listener is not None and self.api_process == 0:
            assert self.admission is not None
            self.extras = ApiProcesses.start(
                self.args, self.model_dir, engines, self.listener, self.admission
            )

    def load_config(self) -> tuple[EngineConfig, list[Source]]:
        """The engine's config as the engine resolves it, and where the parsers and the
        thinking budget may come from: the flags, MODEL.toml, recipes (read and checked now,
        before waiting on the engine)."""
        from metrale import demo
        from metrale.frontend.parser_selection import behavior_sources
        from metrale.models import model_class_for
        from metrale.recipes import Behavior, Checkpoint, repo_id_of

        args = self.args
        with phase("load config", self.bus):
            config = self.engine_args.create_config(self.model_dir)
            model_class_for(config.model.architecture)  # one we cannot run is named here
            watchdog = args.content_loop_watchdog
            flags = Behavior(
                args.tool_call_parser,
                args.reasoning_parser,
                args.max_thinking_budget,
                enable_loop_watchdog=None if watchdog is None else watchdog == "on",
                max_inter_tool_prose=args.max_inter_tool_prose,
            )
            repo_id = (
                demo.repo_id() if config.is_demo else repo_id_of(config.model_name, self.model_dir)
            )
            checkpoint = Checkpoint(repo_id, config.model.architecture, config.model.model_type)
            sources = behavior_sources(flags, self.model_dir, checkpoint)
        return config, sources

    def describe(self, config: EngineConfig) -> None:
        """The kernels, device and ranks the engine runs with, a phase each."""
        from metrale.engine.stats import communication_backend, rank_devices

        with phase("select kernels", self.bus):
            if config.attention_backend == "triton":
                batch, tokens = config.max_cuda_graph_batch, config.max_cuda_graph_tokens
                graphs = [f"decode steps up to batch {batch}"] if batch else []
                graphs += [f"steps with prompt tokens up to {tokens} tokens"] if tokens else []
                logger.info(
                    "attention backend: triton (paged kernels); %s",
                    f"CUDA graphs of {' and '.join(graphs)}" if graphs else "eager, no CUDA graphs",
                )
            else:
                logger.info("attention backend: torch (scaled_dot_product_attention over paged KV)")
        with phase("backend", self.bus):
            dtype = str(config.dtype).removeprefix("torch.")
            logger.info("device %s, dtype %s", config.device, dtype)
        with phase("communication backend", self.bus):
            if config.data_parallel_size > 1:
                logger.info(
                    "data parallelism: %d engine cores, requests routed by prefix affinity, "
                    "then load",
                    config.data_parallel_size,
                )
            if (size := config.model.tensor_parallel_size) == 1:
                logger.info("single rank: no tensor parallelism")
            else:
                logger.info(
                    "tensor parallelism: world size %d, %s, devices %s (rank 0: the engine "
                    "process)",
                    size,
                    communication_backend(config.device, size),
                    ", ".join(rank_devices(config)),
                )

    async def start_engine(
        self, config: EngineConfig, early: EngineClient | list[EngineClient] | None
    ) -> EngineClient | DataParallelClient:
        """The engine, once it has loaded the model: the early one, the cores attached to, or
        every data-parallel core started now."""
        from metrale.engine.data_parallel_client import DataParallelClient
        from metrale.runner.model_loader import preflight_model

        with phase("preflight and weights", self.bus):
            preflight_model(self.model_dir, config.load_format)
            if isinstance(early, EngineClient):
                await early.ready(config)
                return early
            if early is None:
                early = DataParallelClient.launch(
                    config,
                    in_process=self.args.engine_in_thread,
                    api_server_count=self.args.api_server_count,
                )
                self.start_other_api_processes(early)
            return await DataParallelClient.ready(early, config)

    def tokenizer_and_behavior(
        self, config: EngineConfig, sources: list[Source]
    ) -> tuple[Tokenizer, BehaviorChoice]:
        from metrale.frontend.parser_selection import choose_behavior
        from metrale.tokenizer import Tokenizer

        with phase("tokenizer and template", self.bus):
            tokenizer = Tokenizer.from_dir(
                self.model_dir,
                chat_template_path=config.chat_template,
                model_type=config.model.model_type,
            )
            template_text = "\n".join(t.text for t in tokenizer.chat_template.sources.values())
            behavior = choose_behavior(sources, template_text)
            logger.info("%s", behavior.describe())
        return tokenizer, behavior

    @property
    def served_model_name(self) -> str:
        from metrale import demo

        if self.args.served_model_name:
            return self.args.served_model_name
        if self.engine_args.is_demo:
            return demo.MODEL_NAME
        return self.engine_args.model or str(self.model_dir)

    def engine_frontend(
        self,
        client: EngineClient | DataParallelClient,
        config: EngineConfig,
        tokenizer: Tokenizer,
    ) -> AsyncLLM:
        """The API process's side of the engine: requests in, detokenized deltas out, and the
        telemetry of both."""
        from metrale.frontend.async_llm import AsyncLLM
        from metrale.telemetry.hub import Telemetry
        from metrale.telemetry.metrics import Metrics

        with phase("scheduler", self.bus):
            name = self.served_model_name
            metrics = Metrics(name, config.scheduler.max_seq_len) if config.log_stats else None
            telemetry = Telemetry(metrics, self.bus, reports_engine=self.api_process == 0)
            llm = AsyncLLM(client, tokenizer, telemetry, self.args.stream_interval)
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
        return llm

    def server_app(
        self, llm: AsyncLLM, config: EngineConfig, tokenizer: Tokenizer, behavior: BehaviorChoice
    ) -> FastAPI:
        """The HTTP app around the engine: its settings, its state and its routes; with several
        API processes, this one's links to the others' metrics and events."""
        from metrale.server.app import build_app
        from metrale.server.openai.responses.background_peers import BackgroundPeers
        from metrale.server.security.guard import Guard
        from metrale.server.state import ServerState
        from metrale.telemetry.event_peers import EventPeers
        from metrale.telemetry.metrics_peers import MetricsPeers

        with phase("router", self.bus):
            count = self.args.api_server_count
            metrics_peers = None
            if count > 1:
                # They meet beside the (first core's) engine sockets, which every one knows.
                first = getattr(llm.client, "clients", [llm.client])[0]
                directory = first.sockets.directory
                event_peers = EventPeers(self.bus, directory, self.api_process, count)
                event_peers.start()
                self.peers.append(event_peers)
                if llm.telemetry.metrics is not None:
                    metrics_peers = MetricsPeers(
                        directory, self.api_process, count, llm.telemetry.exposition
                    )
                    metrics_peers.start()
                    self.peers.append(metrics_peers)
            settings = self._settings(behavior)
            state = ServerState(
                llm,
                tokenizer,
                config,
                settings,
                serve_config=effective_config(
                    self.args, config, settings, behavior, self.security, llm.client.forward
                ),
                guard=(
                    Guard(self.security)
                    if self.admission is None
                    else self.admission.guard(self.security, self.api_process)
                ),
                store=self.store,
                metrics_peers=metrics_peers,
            )
            if count > 1:
                peers = BackgroundPeers(directory, self.api_process, self.store, state.background)
                peers.start()
                state.background_peers = peers
                self.peers.append(peers)
            if self.security.api_keys:
                logger.info(
                    "API keys: %d; required on %s",
                    len(self.security.api_keys),
                    "every route but /health" if self.security.require_auth else "/v1 routes",
                )
            app = build_app(state)
        return app

    def _settings(self, behavior: BehaviorChoice) -> ServerSettings:
        from metrale.server.state import ServerSettings

        args = self.args
        return ServerSettings(
            served_model_name=self.served_model_name,
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

    async def serve(self, app: FastAPI, on_serving: Callable[[], None] | None = None) -> bool:
        """Serve HTTP until SIGINT or SIGTERM, or until another API process dies (then True);
        the "listening" phase ends when this process and the others serve."""
        extras, listener = self.extras, self.listener
        args = self.args
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
        number = PHASES.index("listening") + 1
        self.bus.publish(Phase(index=number, total=len(PHASES), name="listening"))
        start = time.perf_counter()
        failure: list[str] = []

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            if on_serving is not None:
                on_serving()
            if extras is not None:
                try:
                    await extras.wait_serving()
                except RuntimeError:  # one died first: watch() stops the server
                    return
            _finished(number, "listening", time.perf_counter() - start, self.bus)
            logger.info(
                "serving %s on http://%s:%d%s",
                self.served_model_name,
                args.bind,
                args.port,
                f" ({args.api_server_count} API processes)" if extras is not None else "",
            )

        async def watch() -> None:
            while extras is not None and (reason := extras.dead()) is None:
                await asyncio.sleep(0.2)
            logger.error("%s: shutting the server down", reason)
            failure.append(reason)
            server.handle_exit(signal.SIGTERM, None)

        tasks = [asyncio.create_task(announce())]
        if extras is not None:
            tasks.append(asyncio.create_task(watch()))
        state = app.state.server
        if (waiting := state.guard.waiting) is not None:  # this process's count, for the others
            count = lambda: state.llm.num_waiting + state.guard.num_reserved()  # noqa: E731
            tasks.append(asyncio.create_task(waiting.keep_fresh(count)))
        freeze_startup_heap()
        await server.serve(sockets=None if listener is None else [listener])
        for task in tasks:
            task.cancel()
        return bool(failure)


def _import_server() -> None:
    """Import what the phases after the engine's will use: the server's modules take about a
    second to import, which overlaps the engine's loading here instead of following it."""
    import metrale.frontend.async_llm
    import metrale.frontend.parser_selection
    import metrale.server.app
    import metrale.telemetry.hub
    import metrale.telemetry.metrics
    import metrale.tokenizer  # noqa: F401


class _Server(uvicorn.Server):
    """uvicorn re-raises a caught SIGTERM after its shutdown, killing the process before the
    engine core is stopped; `met serve` owns the signals instead and exits 0 once all is down."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
