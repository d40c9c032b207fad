"""What the routes serve from: the engine, the tokenizer and the server's settings."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from metrale.engine.watchdog import DEFAULT_MIN_REPEATS
from metrale.engine_config import EngineConfig
from metrale.frontend.async_llm import AsyncLLM
from metrale.recipes import SamplingPresets
from metrale.runner.structured_output import StructuredOutputs
from metrale.sampling_params import SamplingParams, StructuredOutput
from metrale.server.errors import APIError, model_not_found
from metrale.server.openai.responses.background_peers import BackgroundPeers
from metrale.server.security.config import SecurityConfig
from metrale.server.security.guard import Guard
from metrale.server.stores import RecordStore, open_store
from metrale.telemetry.metrics_peers import MetricsPeers
from metrale.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    request_timeout_s: float | None = None
    always_include_usage: bool = False
    tool_call_parser: str | None = None  # a registered format; None: tool calls stay text
    reasoning_parser: str | None = None  # None: thinking stays in the content
    reasoning_field: str = "reasoning_content"  # reasoning_content | reasoning | both
    max_thinking_budget: int | None = None  # tokens; None: think as long as the model likes
    content_loop_watchdog: bool = False  # on for requests that do not say
    content_loop_min_repeats: int = DEFAULT_MIN_REPEATS
    max_inter_tool_prose: int | None = None  # tokens of prose between calls; None: no bound
    # a recipe's [sampling.thinking] / [sampling.non_thinking]; None: generation_config.json's
    sampling_presets: SamplingPresets | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.content_loop_min_repeats <= SamplingParams.MAX_LOOP_REPEATS:
            raise ValueError(
                f"--content-loop-min-repeats {self.content_loop_min_repeats}: must be in "
                f"[2, {SamplingParams.MAX_LOOP_REPEATS}]"
            )

    def sampling_defaults(self, generation: dict[str, Any], thinks: bool) -> dict[str, Any]:
        """What a request leaves unset is sampled with: the preset of its kind of turn over
        `generation` (generation_config.json's defaults)."""
        if self.sampling_presets is None:
            return generation
        return {**generation, **self.sampling_presets.for_turn(thinks)}

    @property
    def loop_watchdog(self) -> tuple[bool, int]:
        """What a request that does not mention the watchdog gets: (on, repeats)."""
        return self.content_loop_watchdog, self.content_loop_min_repeats

    disable_thinking: bool = False
    auto_compact: bool = False  # shorten a conversation too long for the context (compaction.py)
    access_log: bool = True  # a log line per request (metrale.access)


@dataclass
class ServerState:
    llm: AsyncLLM
    tokenizer: Tokenizer
    config: EngineConfig
    settings: ServerSettings
    # The effective configuration, as /serve-config reports it (set by `met serve`).
    serve_config: dict[str, Any] = field(default_factory=dict)
    started_at_s: float = field(default_factory=time.time)
    structured_outputs: StructuredOutputs | None = None  # compiled on first use
    guard: Guard = field(default_factory=lambda: Guard(SecurityConfig()))
    # Stored responses, conversations and chat completions (`--response-store`).
    store: RecordStore = field(default_factory=lambda: open_store("memory"))
    # Background responses running now: id -> (their task, their run).
    background: dict[str, tuple[asyncio.Task, Any]] = field(default_factory=dict)
    # With several API processes (`--api-server-count`): the others' /metrics series.
    metrics_peers: MetricsPeers | None = None
    # With several, who runs which background response, and the way to reach it.
    background_peers: BackgroundPeers | None = None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.served_model_name:
            raise model_not_found(name)

    def check_structured_output(self, spec: StructuredOutput) -> None:
        """Compile the grammar here first, so a bad one is a 400 before any stream starts."""
        if self.structured_outputs is None:
            self.structured_outputs = StructuredOutputs(
                self.config.model_dir, self.config.model.vocab_size, self.config.eos_token_ids
            )
        try:
            self.structured_outputs.validate(spec)
        except ValueError as e:
            raise APIError(str(e), param="response_format") from None

    def check_alive(self) -> None:
        if not self.llm.is_alive:
            raise APIError(
                f"the engine is not running ({self.llm.client.dead_reason}); restart the server",
                503,
            )
