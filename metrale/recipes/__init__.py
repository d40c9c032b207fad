"""Model recipes: what a family of checkpoints needs from the server, written as data.

A recipe is a TOML file with two tables:

    [match]                        # which checkpoints it is for; every key given must match
    repo_ids = ["Qwen/Qwen3-*"]    # Hugging Face id globs (case-insensitive)
    architectures = ["Qwen3ForCausalLM"]   # config.json `architectures[0]`
    model_types = ["qwen3"]        # config.json `model_type`

    [behavior]                     # every key optional; one left out is decided further down
    tool_call_parser = "hermes"    # a tool-call format, "auto" (from the template) or "none"
    reasoning_parser = "qwen3"     # a reasoning format or "none"
    max_thinking_budget = 8192     # tokens, when `--max-thinking-budget` is not given
    thinking_steering = true       # false: only a budget the request states is enforced
    enable_loop_watchdog = true    # end a generation that loops (`--content-loop-watchdog`)
    max_inter_tool_prose = 256     # tokens of prose between tool calls (`--max-inter-tool-prose`)

    [sampling.thinking]            # the default sampling of a turn that thinks, and of one that
    temperature = 0.6              # does not ([sampling.non_thinking]); keys: PRESET_KEYS. A
    top_p = 0.95                   # request's own values win; what a preset leaves out comes
    top_k = 20                     # from generation_config.json, as without presets

Recipes come from three places, consulted in this order (the first that makes a choice wins):

1. the checkpoint's own `MODEL.toml` beside config.json; it applies to that checkpoint (its
   `[match]`, if any, is checked for form but not consulted);
2. the local recipe index: the `*.toml` files in `METRALE_RECIPES_DIR`, else
   `$METRALE_CACHE_DIR/recipes`, else `$XDG_CACHE_HOME/metrale/recipes` (by default
   `~/.cache/metrale/recipes`), filled by `met sync-recipes` (`metrale.recipes.sync`); a missing
   directory is an empty index;
3. the recipes shipped in this folder; one whose file name a local recipe also has is not
   consulted (the local one overrides it).

Within the local index, and within the shipped recipes, the most specific match wins (see
`Match.specificity`). A file that does not parse, has an unknown key or names an unknown parser
is an error naming the file, raised when the recipes are read at startup.
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from metrale import envs
from metrale.frontend.reasoning import reasoning_parser_names
from metrale.frontend.tool_parsers import tool_parser_names

CHECKPOINT_RECIPE = "MODEL.toml"
SHIPPED_FOLDER = "metrale/recipes"  # how messages and labels name this folder
RECIPES_DIR_ENV = "METRALE_RECIPES_DIR"
AUTO = "auto"
NONE = "none"


class RecipeError(ValueError):
    """A recipe file that cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class Checkpoint:
    """What recipes match on."""

    repo_id: str | None  # a Hugging Face id; None for a directory outside the hub cache
    architecture: str
    model_type: str


@dataclass(frozen=True)
class Behavior:
    """A `[behavior]` table. None leaves the choice to the next source in line."""

    tool_call_parser: str | None = None  # a registered format, "auto" or "none"
    reasoning_parser: str | None = None  # a registered format or "none"
    max_thinking_budget: int | None = None  # tokens
    thinking_steering: bool | None = None  # False: no budget the request did not ask for
    enable_loop_watchdog: bool | None = None  # the content-loop watchdog on by default
    max_inter_tool_prose: int | None = None  # tokens; 0: no bound


@dataclass(frozen=True)
class Match:
    """A `[match]` table: a checkpoint matches when every key given matches."""

    repo_ids: tuple[str, ...] = ()  # globs
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()

    def specificity(self, checkpoint: Checkpoint) -> tuple[int, int, int] | None:
        """None if `checkpoint` does not match; else a rank, higher for a more specific match:
        a repo-id match beats one on the config alone, a longer literal glob beats a shorter
        one (`Qwen/Qwen3-Coder-*` beats `Qwen/Qwen3-*`), then more keys beat fewer."""
        if self.architectures and checkpoint.architecture not in self.architectures:
            return None
        if self.model_types and checkpoint.model_type not in self.model_types:
            return None
        glob_len = 0
        if self.repo_ids:
            if checkpoint.repo_id is None:
                return None
            repo_id = checkpoint.repo_id.lower()
            matched = [g for g in self.repo_ids if fnmatch.fnmatchcase(repo_id, g.lower())]
            if not matched:
                return None
            glob_len = max(len(g.replace("*", "").replace("?", "")) for g in matched)
        num_keys = sum(bool(k) for k in (self.repo_ids, self.architectures, self.model_types))
        return (int(bool(self.repo_ids)), glob_len, num_keys)


# The SamplingParams fields a [sampling.*] preset may set: those a request leaves unset by
# omitting them, so that its own values always win.
PRESET_KEYS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "top_n_sigma",
    "typical_p",
    "xtc_threshold",
    "xtc_probability",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "repetition_penalty_window",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "lz_penalty",
)
INTEGER_PRESET_KEYS = (
    "top_k",
    "repetition_penalty_window",
    "dry_allowed_length",
    "dry_penalty_last_n",
)


@dataclass(frozen=True)
class SamplingPresets:
    """A recipe's `[sampling.thinking]` and `[sampling.non_thinking]`: the default sampling of a
    turn that thinks and of one that does not (empty: that mode has none)."""

    thinking: dict[str, float] = field(default_factory=dict)
    non_thinking: dict[str, float] = field(default_factory=dict)

    def for_turn(self, thinks: bool) -> dict[str, float]:
        return self.thinking if thinks else self.non_thinking


@dataclass(frozen=True)
class Recipe:
    name: str  # the file's stem for a shipped or local recipe; "MODEL.toml" for a checkpoint's
    path: str  # for messages and source labels
    match: Match | None  # None: no [match] table (a checkpoint's MODEL.toml may omit it)
    behavior: Behavior
    sampling: SamplingPresets | None = None  # None: no [sampling] table


def parse_sampling(table: Any, where: str) -> SamplingPresets:
    """A `[sampling]` table: its `thinking` and `non_thinking` presets, each checked as the
    sampling parameters it makes."""
    from metrale.sampling_params import SamplingParams

    _check_table(table, where, SamplingPresets)
    presets = {}
    for mode, preset in table.items():
        if not isinstance(preset, dict):
            raise RecipeError(f"{where}.{mode} must be a table")
        unknown = sorted(set(preset) - set(PRESET_KEYS))
        if unknown:
            raise RecipeError(
                f"{where}.{mode}: unknown key {', '.join(unknown)}: known keys are "
                f"{', '.join(PRESET_KEYS)}"
            )
        for key, value in preset.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise RecipeError(f"{where}.{mode}: {key} = {value!r} is not a number")
            if key in INTEGER_PRESET_KEYS and not isinstance(value, int):
                raise RecipeError(f"{where}.{mode}: {key} = {value!r} is not an integer")
        try:
            SamplingParams(**preset)
        except ValueError as e:
            raise RecipeError(f"{where}.{mode}: {e}") from None
        presets[mode] = dict(preset)
    return SamplingPresets(**presets)


def parse_behavior(table: Any, where: str) -> Behavior:
    """A `[behavior]` table (or a `tool_defaults.toml` entry), checked; `where` names it."""
    _check_table(table, where, Behavior)
    for key, value in table.items():
        if (problem := behavior_value_problem(key, value)) is not None:
            raise RecipeError(f"{where}: {key} = {value!r} {problem}")
    return Behavior(**table)


def behavior_value_problem(key: str, value: object) -> str | None:
    """What is wrong with `value` for the `[behavior]` key `key` (and what to do), or None."""
    if key == "tool_call_parser":
        known = [name for name in tool_parser_names() if name != AUTO]
        if not isinstance(value, str) or value not in (*known, AUTO, NONE):
            return f"is not a known format: use one of {', '.join(known)}, {AUTO} or {NONE}"
    elif key == "reasoning_parser":
        known = reasoning_parser_names()
        if not isinstance(value, str) or value not in (*known, NONE):
            return f"is not a known format: use one of {', '.join(known)} or {NONE}"
    elif key in ("max_thinking_budget", "max_inter_tool_prose"):
        if type(value) is not int or value < 0:
            return "is not a token count: use an integer >= 0"
    elif key in ("thinking_steering", "enable_loop_watchdog") and not isinstance(value, bool):
        return "is not a boolean: use true or false"
    return None


def parse_recipe(text: str, path: str, name: str, *, require_match: bool) -> Recipe:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path} is not valid TOML: {e}") from None
    unknown = sorted(set(doc) - {"match", "behavior", "sampling"})
    if unknown:
        raise RecipeError(
            f"{path}: unknown table or key {', '.join(unknown)}: a recipe has [match], "
            f"[behavior] and [sampling.thinking] / [sampling.non_thinking]"
        )
    if require_match and "match" not in doc:
        raise RecipeError(
            f"{path}: a recipe needs a [match] table naming its checkpoints (only a checkpoint's "
            f"own {CHECKPOINT_RECIPE} may leave it out)"
        )
    match = _parse_match(doc["match"], f"{path} [match]") if "match" in doc else None
    behavior = parse_behavior(doc.get("behavior", {}), f"{path} [behavior]")
    sampling = parse_sampling(doc["sampling"], f"{path} [sampling]") if "sampling" in doc else None
    return Recipe(name, path, match, behavior, sampling)


def shipped_recipes() -> list[Recipe]:
    """Every recipe in this package, each checked."""
    folder = resources.files(__name__)
    return [
        parse_recipe(
            entry.read_text(),
            f"{SHIPPED_FOLDER}/{entry.name}",
            entry.name.removesuffix(".toml"),
            require_match=True,
        )
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".toml")
    ]


def local_index_dir() -> Path:
    """Where `met sync-recipes` installs recipes and `met serve` reads them: METRALE_RECIPES_DIR,
    else `recipes` in Metrale's cache directory (`metrale.envs.cache_dir`)."""
    if path := os.environ.get(RECIPES_DIR_ENV):
        return Path(path).expanduser()
    return envs.cache_dir() / "recipes"


def local_recipes(index_dir: Path | None = None) -> list[Recipe]:
    """Every recipe in the local index (`local_index_dir()` unless given), each checked as
    strictly as a shipped one; a missing directory is an empty index."""
    folder = local_index_dir() if index_dir is None else index_dir
    if not folder.is_dir():
        return []
    recipes = []
    for path in sorted(folder.glob("*.toml")):
        if path.name.startswith(".") or not path.is_file():
            continue
        try:
            recipes.append(parse_recipe_file(path))
        except RecipeError as e:
            raise RecipeError(
                f"{e} (in the local recipe index {folder}: fix or delete the file, or run "
                f"`met sync-recipes` to install a good copy)"
            ) from None
    return recipes


def parse_recipe_file(path: Path, label: str | None = None) -> Recipe:
    """A recipe file outside the package, named by its stem and, in messages, by `label`
    (default: its path)."""
    where = str(path) if label is None else label
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{where} is not UTF-8 text") from None
    return parse_recipe(text, where, path.stem, require_match=True)


def checkpoint_recipe(model_dir: Path) -> Recipe | None:
    """The checkpoint's own `MODEL.toml`, if it has one."""
    path = model_dir / CHECKPOINT_RECIPE
    if not path.is_file():
        return None
    return parse_recipe(path.read_text(), str(path), CHECKPOINT_RECIPE, require_match=False)


def match_recipe(checkpoint: Checkpoint, recipes: Iterable[Recipe]) -> Recipe | None:
    """The most specific recipe matching `checkpoint`; two equally specific ones are an error."""
    ranked = [
        (rank, recipe)
        for recipe in recipes
        if recipe.match is not None and (rank := recipe.match.specificity(checkpoint)) is not None
    ]
    if not ranked:
        return None
    ranked.sort(key=lambda r: r[0], reverse=True)
    if len(ranked) > 1 and ranked[0][0] == ranked[1][0]:
        raise RecipeError(
            f"recipes {ranked[0][1].path} and {ranked[1][1].path} match {_describe(checkpoint)} "
            f"equally well: narrow one's [match]"
        )
    return ranked[0][1]


def repo_id_of(model: str | None, model_dir: Path) -> str | None:
    """The Hugging Face id a checkpoint came from: `model` as named unless it is a directory,
    else read off a hub-cache path (`.../models--ORG--NAME/snapshots/REV`)."""
    if model is not None and not Path(model).expanduser().is_dir():
        return model
    for part in reversed(model_dir.expanduser().absolute().parts):
        if part.startswith("models--") and "--" in part.removeprefix("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    return None


def _parse_match(table: Any, where: str) -> Match:
    _check_table(table, where, Match)
    values: dict[str, tuple[str, ...]] = {}
    for key in ("repo_ids", "architectures", "model_types"):
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise RecipeError(f'{where}: {key} must be a list of strings, e.g. {key} = ["..."]')
        values[key] = tuple(value)
    if not any(values.values()):
        raise RecipeError(
            f"{where}: names no checkpoints: give repo_ids, architectures or model_types"
        )
    return Match(**values)


def _check_table(table: Any, where: str, shape: type) -> None:
    if not isinstance(table, dict):
        raise RecipeError(f"{where} must be a table")
    known = [f.name for f in fields(shape)]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise RecipeError(
            f"{where}: unknown key {', '.join(unknown)}: known keys are {', '.join(known)}"
        )


def _describe(checkpoint: Checkpoint) -> str:
    return checkpoint.repo_id or f"{checkpoint.architecture} ({checkpoint.model_type})"
