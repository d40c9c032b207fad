"""Which tool-call and reasoning parsers a served model gets, and its thinking budget.

Each choice is taken from the first source that makes it, in this order:

1. the flag (`--tool-call-parser`, `--reasoning-parser`, `--max-thinking-budget`);
2. the checkpoint's own `MODEL.toml` `[behavior]` (see `metrale.recipes`);
3. the best-matching recipe in the local index (`met sync-recipes`, `local_index_dir()`);
4. the best-matching shipped recipe (`metrale/recipes/*.toml`), leaving out any whose file name
   a local recipe also has;
5. `tool_defaults.toml`, keyed by the checkpoint's `model_type` (parsers only);
6. for tool calls, the format the chat template reveals; else none.

A source saying "none" ends the search; a tool-call parser of "auto" means step 6. When the
recipes set `thinking_steering = false` there is no server-wide thinking budget at all: only
a budget a request states is enforced.

`behavior_sources` reads and checks every file and flag, early in startup; `choose_behavior`
then needs only the chat template.
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from metrale.frontend.tool_parsers import detect_tool_parser
from metrale.recipes import (
    AUTO,
    NONE,
    Behavior,
    Checkpoint,
    Recipe,
    SamplingPresets,
    behavior_value_problem,
    checkpoint_recipe,
    local_recipes,
    match_recipe,
    parse_behavior,
    shipped_recipes,
)

logger = logging.getLogger(__name__)

FLAGS = "flags"


# flags whose name is not the [behavior] key's
_FLAG_NAMES = {"enable_loop_watchdog": "--content-loop-watchdog"}


@dataclass(frozen=True)
class Source:
    """One place choices come from; `label` is what the startup log says."""

    label: str  # FLAGS for the command line, else e.g. "recipe qwen3 (metrale/recipes/...)"
    behavior: Behavior
    sampling: SamplingPresets | None = None  # a recipe's [sampling] presets

    def label_for(self, field: str) -> str:
        if self.label != FLAGS:
            return self.label
        return _FLAG_NAMES.get(field) or "--" + field.replace("_", "-")


@dataclass(frozen=True)
class BehaviorChoice:
    """What the server runs with, and where each value came from."""

    tool_call_parser: str | None  # None: tool calls stay text
    reasoning_parser: str | None  # None: thinking stays in the content
    max_thinking_budget: int | None  # tokens; None: only what a request asks for
    tool_call_parser_source: str
    reasoning_parser_source: str
    max_thinking_budget_source: str
    loop_watchdog: bool = False  # the content-loop watchdog on unless a request turns it off
    loop_watchdog_source: str = "default"
    max_inter_tool_prose: int | None = None  # tokens; None: no bound
    max_inter_tool_prose_source: str = "default"
    sampling_presets: SamplingPresets | None = None  # None: generation_config.json's alone
    sampling_presets_source: str = "none"

    def describe(self) -> str:
        budget = "none" if self.max_thinking_budget is None else f"{self.max_thinking_budget}"
        return (
            f"tool-call parser {self.tool_call_parser or NONE} ({self.tool_call_parser_source}); "
            f"reasoning parser {self.reasoning_parser or NONE} "
            f"({self.reasoning_parser_source}); "
            f"max thinking budget {budget} ({self.max_thinking_budget_source}); "
            f"content-loop watchdog {'on' if self.loop_watchdog else 'off'} "
            f"({self.loop_watchdog_source}); "
            f"max inter-tool prose {self.max_inter_tool_prose or 'none'} "
            f"({self.max_inter_tool_prose_source})"
        )


def model_type_defaults(model_type: str) -> Behavior:
    """`tool_defaults.toml`'s entry for `model_type`; empty if it has none."""
    entry = resources.files("metrale.frontend") / "tool_defaults.toml"
    table = tomllib.loads(entry.read_text()).get(model_type, {})
    return parse_behavior(table, f"{entry} [{model_type}]")


def behavior_sources(
    flags: Behavior,
    model_dir: Path,
    checkpoint: Checkpoint,
    recipes: Sequence[Recipe] | None = None,
    local: Sequence[Recipe] | None = None,
) -> tuple[Source, ...]:
    """Every source of choices for this checkpoint, first wins. `flags` holds the command
    line's values; `recipes` defaults to the shipped ones, `local` to the local index's.
    Raises ValueError (RecipeError for a file) naming what is wrong."""
    for field, value in vars(flags).items():
        if value is not None and (problem := behavior_value_problem(field, value)) is not None:
            raise ValueError(f"--{field.replace('_', '-')} {value!r} {problem}")
    sources = [Source(FLAGS, flags)]
    if (own := checkpoint_recipe(model_dir)) is not None:
        sources.append(Source(f"checkpoint's {own.path}", own.behavior, own.sampling))
    local = local_recipes() if local is None else local
    if (best_local := match_recipe(checkpoint, local)) is not None:
        label = f"local recipe {best_local.name} ({best_local.path})"
        sources.append(Source(label, best_local.behavior, best_local.sampling))
    overridden = {r.name for r in local}  # a local file of a shipped one's name replaces it
    shipped = shipped_recipes() if recipes is None else recipes
    best_shipped = match_recipe(checkpoint, [r for r in shipped if r.name not in overridden])
    if best_shipped is not None:
        label = f"recipe {best_shipped.name} ({best_shipped.path})"
        sources.append(Source(label, best_shipped.behavior, best_shipped.sampling))
    defaults = model_type_defaults(checkpoint.model_type)
    sources.append(Source(f"tool_defaults.toml, model_type {checkpoint.model_type}", defaults))
    return tuple(sources)


def choose_behavior(sources: Sequence[Source], chat_template: str) -> BehaviorChoice:
    tool, tool_from = _first(sources, "tool_call_parser")
    if tool is None or tool == AUTO:
        tool = detect_tool_parser(chat_template)
        tool_from = "chat template" if tool is not None else "no format in the chat template"
    reasoning, reasoning_from = _first(sources, "reasoning_parser")
    budget, budget_from = _first(sources, "max_thinking_budget")
    steering, steering_from = _first(sources, "thinking_steering")
    if steering is False:
        flag_budget = sources[0].behavior.max_thinking_budget if sources[0].label == FLAGS else None
        if flag_budget is not None:
            logger.warning(
                "--max-thinking-budget %d is not applied: %s sets thinking_steering = false, "
                "so only a budget a request states is enforced",
                flag_budget,
                steering_from,
            )
        budget, budget_from = None, f"thinking_steering = false in {steering_from}"
    watchdog, watchdog_from = _first(sources, "enable_loop_watchdog")
    prose, prose_from = _first(sources, "max_inter_tool_prose")
    # the first source with a [sampling] table gives both presets
    presets = next((s for s in sources if s.sampling is not None), None)
    return BehaviorChoice(
        None if tool in (None, NONE) else tool,
        None if reasoning in (None, NONE) else reasoning,
        budget,
        tool_from,
        reasoning_from,
        budget_from,
        bool(watchdog),
        watchdog_from,
        prose or None,
        prose_from,
        presets.sampling if presets is not None else None,
        presets.label if presets is not None else "none",
    )


def _first(sources: Sequence[Source], field: str) -> tuple[Any, str]:
    for source in sources:
        value = getattr(source.behavior, field)
        if value is not None:
            return value, source.label_for(field)
    return None, "default"
