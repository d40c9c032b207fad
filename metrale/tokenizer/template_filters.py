"""The filters chat templates see: jinja2's own and Hugging Face's ``tojson``, each guarded.

Every filter reads the render's clock and has its result's size checked; the filters whose
result can far outgrow their input (``join``, ``replace``, widths, paddings, ``format``) have
an estimate checked before they run; those that turn a value into text refuse Python objects.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

from metrale.tokenizer.template_budget import (
    ChatTemplateBudgetError,
    ChatTemplateSecurityError,
    RenderBudget,
    current_budget,
    length,
    materialized,
    printf_size,
    require_printable,
)


def guarded_filters(filters: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """``filters`` (an environment's) with our ``tojson``, each wrapped in its guard."""
    guarded = {name: _guarded_filter(name, f) for name, f in {**filters, "tojson": _tojson}.items()}
    for name in _UNAVAILABLE_FILTERS:
        guarded[name] = _unavailable_filter(name)
    return guarded


def _check_join(budget: RenderBudget, arguments: dict[str, Any]) -> None:
    arguments["value"] = items = materialized(arguments["value"])
    separator = arguments.get("d", "")
    size = budget.size_of(items) + budget.size_of(separator) * max(length(items) - 1, 0)
    budget.check_size(size, "the join filter's result")


def _check_replace(budget: RenderBudget, arguments: dict[str, Any]) -> None:
    text, old, new = arguments["s"], arguments["old"], arguments["new"]
    text_size = budget.size_of(text)
    count = text_size + 1
    if isinstance(text, str) and isinstance(old, str) and old:
        count = text.count(old)
    if isinstance(arguments.get("count"), int) and arguments["count"] >= 0:
        count = min(count, arguments["count"])
    size = text_size + count * budget.size_of(new)
    budget.check_size(size, "the replace filter's result")


def _check_width(parameter: str) -> Callable[[RenderBudget, dict[str, Any]], None]:
    def check(budget: RenderBudget, arguments: dict[str, Any]) -> None:
        width = arguments.get(parameter, 0)
        if isinstance(width, int):
            budget.check_size(width, f"a {parameter} of {width:,}")

    return check


def _check_indent(budget: RenderBudget, arguments: dict[str, Any]) -> None:
    text, width = arguments["s"], arguments.get("width", 4)
    lines = text.count("\n") + 1 if isinstance(text, str) else budget.size_of(text)
    prefix = width if isinstance(width, int) else budget.size_of(width)
    budget.check_size(budget.size_of(text) + lines * prefix, "the indent filter's result")


def _check_wordwrap(budget: RenderBudget, arguments: dict[str, Any]) -> None:
    text, width = arguments["s"], arguments.get("width", 79)
    text_size = budget.size_of(text)
    newlines = text.count("\n") if isinstance(text, str) else text_size
    lines = (text_size // width if isinstance(width, int) and width > 0 else text_size) + newlines
    separator = arguments.get("wrapstring") or "\n"
    budget.check_size(text_size + lines * budget.size_of(separator), "the wordwrap filter's result")


def _check_batch(budget: RenderBudget, arguments: dict[str, Any]) -> None:
    count = arguments["linecount"]
    fill = arguments.get("fill_with")
    if isinstance(count, int) and fill is not None:
        budget.check_size(count * (budget.size_of(fill) + 2), "the batch filter's padding")


def _check_slice(budget: RenderBudget, arguments: dict[str, Any]) -> None:
    count = arguments["slices"]
    if isinstance(count, int):
        fill_size = budget.size_of(arguments.get("fill_with")) + 2
        budget.check_size(count * fill_size, f"the slice filter's {count:,} slices")


def _check_format(budget: RenderBudget, arguments: dict[str, Any]) -> None:
    text = arguments["value"]
    if isinstance(text, str):
        values = arguments.get("args") or (arguments.get("kwargs") or {})
        budget.check_size(printf_size(budget, text, values), "the format filter's result")


def _check_sum(budget: RenderBudget, arguments: dict[str, Any]) -> None:
    # Summing sequences copies the running total at each step: quadratic in their number.
    arguments["iterable"] = items = materialized(arguments["iterable"])
    start = arguments.get("start", 0)
    if not isinstance(start, int | float) and length(items) > MAX_SUM_SEQUENCES:
        raise ChatTemplateBudgetError(
            f"the sum filter over {length(items):,} sequences would take quadratic time; chat "
            f"templates may sum at most {MAX_SUM_SEQUENCES:,}"
        )


MAX_SUM_SEQUENCES = 1000

_FILTER_CHECKS: dict[str, Callable[[RenderBudget, dict[str, Any]], None]] = {
    "join": _check_join,
    "replace": _check_replace,
    "center": _check_width("width"),
    "indent": _check_indent,
    "wordwrap": _check_wordwrap,
    "batch": _check_batch,
    "slice": _check_slice,
    "format": _check_format,
    "sum": _check_sum,
}

# Filters whose regular expressions can take quadratic time on hostile text; no chat template
# of a released model uses them.
_UNAVAILABLE_FILTERS = ("striptags", "urlize")
# Filters that turn their first argument into text (join: its items).
_TEXT_FILTERS = frozenset(
    {"capitalize", "center", "e", "escape", "forceescape", "format", "indent", "join", "lower"}
    | {"pprint", "replace", "safe", "string", "title", "trim", "truncate", "upper", "urlencode"}
    | {"wordcount", "wordwrap", "xmlattr"}
)


def _guarded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    check = _FILTER_CHECKS.get(name)
    # jinja2 passes the context, eval context or environment first to filters marked so; the
    # check binds the rest to the filter's own parameters (some builtins' signatures name the
    # first argument, some, wrapped for async, do not).
    passes_first = getattr(func, "jinja_pass_arg", None) is not None
    signature = _signature_after_pass_arg(func) if check is not None else None
    makes_text = name in _TEXT_FILTERS

    @functools.wraps(func)  # keeps jinja_pass_arg: the filter gets its context as before
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.check_time()
        head, rest = (args[:1], args[1:]) if passes_first else ((), args)
        if check is not None and signature is not None:
            bound = signature.bind(*rest, **kwargs)
            bound.apply_defaults()
            check(budget, bound.arguments)
            args, kwargs = (*head, *bound.args), bound.kwargs
            rest = bound.args
        if makes_text and rest:
            require_printable(rest[0])
        result = func(*args, **kwargs)
        budget.check_value(result, f"the {name} filter's result")
        return result

    return guarded


def _signature_after_pass_arg(func: Callable[..., Any]) -> inspect.Signature:
    parameters = list(inspect.signature(func).parameters.values())
    if parameters and parameters[0].name in ("context", "eval_ctx", "environment", "env"):
        parameters = parameters[1:]
    return inspect.Signature(parameters)


def _unavailable_filter(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ChatTemplateSecurityError(
            f"the {name} filter is not available to chat templates (its regular expression can "
            "take quadratic time)"
        )

    return refuse


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja2's builtin, no HTML escaping: prompts must contain the JSON verbatim. The
    # encoder's chunks are counted as they come (json.dumps would build the text in one go).
    budget = current_budget()
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    chunks: list[str] = []
    size = 0
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        budget.check_size(size, "the tojson filter's result")
        chunks.append(chunk)
    return "".join(chunks)
