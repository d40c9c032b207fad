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

The recipes shipped in this folder are matched against the served checkpoint; the most specific
match wins (see `Match.specificity`). A checkpoint directory may carry its own `MODEL.toml`
beside config.json, in the same format; it applies to that checkpoint (its `[match]`, if any,
is checked for form but not consulted) and wins over any shipped recipe. A file that does not
parse, has an unknown key or names an unknown parser is an error naming the file, raised when
the recipes are read at startup.
"""

from __future__ import annotations

import fnmatch
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from metrale.frontend.reasoning import reasoning_parser_names
from metrale.frontend.tool_parsers import tool_parser_names

CHECKPOINT_RECIPE = "MODEL.toml"
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


@dataclass(frozen=True)
class Recipe:
    name: str  # the file's stem for a shipped recipe; "MODEL.toml" for a checkpoint's own
    path: str  # for messages
    match: Match | None  # None: no [match] table (a checkpoint's MODEL.toml may omit it)
    behavior: Behavior


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
    elif key == "max_thinking_budget":
        if type(value) is not int or value < 0:
            return "is not a token count: use an integer >= 0"
    elif key == "thinking_steering" and not isinstance(value, bool):
        return "is not a boolean: use true or false"
    return None


def parse_recipe(text: str, path: str, name: str, *, require_match: bool) -> Recipe:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path} is not valid TOML: {e}") from None
    unknown = sorted(set(doc) - {"match", "behavior"})
    if unknown:
        raise RecipeError(
            f"{path}: unknown table or key {', '.join(unknown)}: a recipe has [match] and "
            f"[behavior]"
        )
    if require_match and "match" not in doc:
        raise RecipeError(f"{path}: a shipped recipe needs a [match] table naming its checkpoints")
    match = _parse_match(doc["match"], f"{path} [match]") if "match" in doc else None
    behavior = parse_behavior(doc.get("behavior", {}), f"{path} [behavior]")
    return Recipe(name, path, match, behavior)


def shipped_recipes() -> list[Recipe]:
    """Every recipe in this package, each checked."""
    folder = resources.files(__name__)
    return [
        parse_recipe(
            entry.read_text(), str(entry), entry.name.removesuffix(".toml"), require_match=True
        )
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".toml")
    ]


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
