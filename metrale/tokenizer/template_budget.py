"""What one chat template render may take, and the estimates checked against it.

`RenderBudget` owns one compile's or render's deadline, size allowance and call depth. The
sandbox's hooks (`template_sandbox.py`) consult it before every operation that can take time
or grow a value, and find it through `current_budget()`: jinja2 hands its hooks no argument to
carry it, and a template variable would be visible to the template.

Sizes are characters of a value's text (what ``str()`` would give), estimated from strings'
lengths and containers' contents. The estimate of an operation's result is checked *before* the
operation runs, so that ``'x' * 10**10`` is refused without being allocated.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sized
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2.utils
from jinja2.runtime import Undefined


class ChatTemplateError(ValueError):
    """The template cannot render this conversation (or there is no template): a client error."""


class ChatTemplateBudgetError(ChatTemplateError):
    """A render ran past its time, size, call-depth or range budget."""


class ChatTemplateSecurityError(ChatTemplateError):
    """The template reached for something the sandbox refuses (a file, an internal attribute)."""


@dataclass(frozen=True)
class RenderLimits:
    """What one render of a chat template may take.

    The size budget scales with the input: ``base_size`` for the template's own text (system
    prompts, tool preambles) plus ``size_per_input`` characters per character of messages,
    tools and variables, since a template may render a message more than once (its content,
    its reasoning, its tool calls as JSON). Real templates take milliseconds and a little more
    than their input; these limits are far above that and far below what hurts a server.
    """

    time_s: float = 2.0
    base_size: int = 4 * 2**20
    size_per_input: int = 4
    max_call_depth: int = 64  # below Python's recursion limit at ~6 frames per macro call
    max_template_chars: int = 2**20  # real templates are tens of KiB

    def __post_init__(self) -> None:
        for name in ("time_s", "base_size", "size_per_input", "max_call_depth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RenderLimits.{name}={getattr(self, name)} must be positive")

    def max_size(self, input_size: int) -> int:
        return self.base_size + self.size_per_input * input_size


# Integers a template computes stay far below Python's 4,300-digit limit for printing them.
MAX_INT_BITS = 4096
# Containers of at least this size keep their size for the rest of the render (with a reference,
# so that their id is not reused), so that wrapping a large list again costs nothing; the
# number of entries is capped to bound the memory this holds.
_SIZE_CACHE_MIN = 1024
_SIZE_CACHE_ENTRIES = 65536
_SCALAR_SIZE = 8  # None, bools, floats and opaque objects: a guess of their text's length

_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
# What a template may turn into text: data, whose text shows no Python object's repr.
_PRINTABLE = (str, int, float, type(None), list, tuple, dict, set, frozenset, range, *_DICT_VIEWS)


class RenderBudget:
    """One compile's or render's clock, size allowance and call depth.

    A container shared several times counts each time, as its text would, but is walked once,
    so that ``[x, x]`` nested twenty times is measured in twenty steps, not a million.
    """

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.max_size = limits.max_size(0)
        self.deadline = time.monotonic() + limits.time_s
        self.output_bytes = 0
        self.call_depth = 0
        self._sizes: dict[int, tuple[object, int]] = {}

    def scale_to_input(self, variables: Mapping[str, Any]) -> None:
        """Grow the size budget with the render's input (messages, tools, variables)."""
        self.max_size = self.limits.max_size(self.size_of(dict(variables)))

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateBudgetError(
                f"the chat template ran past its time budget of {self.limits.time_s:g} s "
                "(an unbounded loop?)"
            )

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_size:
            raise ChatTemplateBudgetError(
                f"{what} would hold {size:,} characters, past the chat template's size budget "
                f"of {self.max_size:,} for this conversation"
            )

    def check_value(self, value: object, what: str) -> None:
        if isinstance(value, str | bytes):
            self.check_size(len(value), what)
        elif isinstance(value, list | tuple | dict | set | frozenset):
            self.check_size(self.size_of(value), what)

    def add_output(self, chunk: str) -> None:
        self.output_bytes += len(chunk.encode("utf-8", "surrogatepass"))
        if self.output_bytes > self.max_size:
            raise ChatTemplateBudgetError(
                f"the chat template's output passed {self.max_size:,} bytes, its size budget "
                "for this conversation"
            )
        self.check_time()

    def enter_call(self) -> None:
        self.call_depth += 1
        if self.call_depth > self.limits.max_call_depth:
            self.call_depth -= 1
            raise ChatTemplateBudgetError(
                f"the chat template's calls nest more than {self.limits.max_call_depth} deep "
                "(a macro recursing without end?)"
            )

    def exit_call(self) -> None:
        self.call_depth -= 1

    def size_of(self, value: object) -> int:
        return self._size(value, {})

    def remember_size(self, value: object, size: int) -> None:
        """Record a list's or tuple's size (an upper bound) computed another way."""
        if (
            isinstance(value, list | tuple)
            and size >= _SIZE_CACHE_MIN
            and len(self._sizes) < _SIZE_CACHE_ENTRIES
        ):
            self._sizes[id(value)] = (value, size)

    def _size(self, value: object, memo: dict[int, int]) -> int:
        if isinstance(value, str | bytes):
            return len(value)
        if isinstance(value, bool) or not isinstance(
            value, int | Iterable | jinja2.utils.Namespace
        ):
            return _SCALAR_SIZE
        if isinstance(value, int):
            return value.bit_length() // 3 + 2
        key = id(value)
        if key in memo:
            return memo[key]
        if key in self._sizes:
            return self._sizes[key][1]
        children = _children(value)
        if children is None:  # a generator or other lazy iterable: its consumer is checked
            return _SCALAR_SIZE
        total = 2 + sum(self._size(child, memo) + 2 for child in children)
        memo[key] = total
        if total >= _SIZE_CACHE_MIN and len(self._sizes) < _SIZE_CACHE_ENTRIES:
            self._sizes[key] = (value, total)
        return total


def _children(value: object) -> Iterable[object] | None:
    """What a container's text is made of, or None for lazy iterables."""
    if isinstance(value, Mapping):
        return [part for pair in value.items() for part in pair]
    if isinstance(value, list | tuple | set | frozenset | range):
        return value
    if isinstance(value, _DICT_VIEWS):
        return list(value)
    if isinstance(value, jinja2.utils.Namespace):
        return _children(object.__getattribute__(value, "_Namespace__attrs"))
    if isinstance(value, jinja2.utils.Cycler):
        return value.items
    return None


def require_printable(value: Any) -> None:
    """Refuse turning a function, class or other Python object into text: its repr would leak
    Python internals (names, addresses) into the prompt."""
    _require_printable(value, set())


def _require_printable(value: Any, seen: set[int]) -> None:
    if isinstance(value, str | Undefined):  # Undefined prints as nothing
        return
    if not isinstance(value, _PRINTABLE):
        raise ChatTemplateSecurityError(
            f"chat templates can turn only data (strings, numbers, lists, mappings) into text, "
            f"not a {type(value).__name__!r} object"
        )
    if id(value) in seen:
        return
    seen.add(id(value))
    for child in _children(value) or ():
        _require_printable(child, seen)


_ACTIVE: ContextVar[RenderBudget | None] = ContextVar("metrale_template_budget", default=None)


def current_budget() -> RenderBudget:
    """The budget of the compile or render under way (a fresh default one outside any)."""
    budget = _ACTIVE.get()
    return budget if budget is not None else RenderBudget(RenderLimits())


@contextlib.contextmanager
def active_budget(budget: RenderBudget) -> Iterator[RenderBudget]:
    token = _ACTIVE.set(budget)
    try:
        yield budget
    finally:
        _ACTIVE.reset(token)


# --- estimates of results that can outgrow their inputs ---------------------------------------

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def printf_size(budget: RenderBudget, text: str, args: object) -> int:
    """An upper bound on ``len(text % args)``: the text, the arguments, every width.

    Positional arguments are used once each; a mapping's values may each be used by every
    specifier.
    """
    specs = list(_PRINTF_SPEC.finditer(text))
    if isinstance(args, Mapping):
        values: tuple[Any, ...] = tuple(args.values())
        inserted = len(specs) * max((budget.size_of(v) for v in values), default=0)
    else:
        values = args if isinstance(args, tuple) else (args,)
        inserted = sum(budget.size_of(value) for value in values)
    for value in values:
        require_printable(value)
    size = len(text) + inserted
    starred = False
    for match in specs:
        for number in match.groups():
            if number == "*":
                starred = True
            elif number:
                size += int(number)
    if starred:  # widths taken from the arguments
        size += sum(abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool))
    return size


def binop_size(budget: RenderBudget, operator: str, left: Any, right: Any) -> int | None:
    """The result's size for operators that can grow a sequence, else None (nothing to check).

    Integer results are checked here too: their bits, not their text.
    """
    sequences = str | bytes | list | tuple
    if operator == "*":
        if isinstance(left, int) and isinstance(right, sequences):
            left, right = right, left
        if isinstance(left, sequences) and isinstance(right, int):
            return budget.size_of(left) * max(right, 0)
        if isinstance(left, int) and isinstance(right, int):
            _check_int_bits(left.bit_length() + right.bit_length())
    elif operator == "+":
        if isinstance(left, sequences) and isinstance(right, sequences):
            return budget.size_of(left) + budget.size_of(right)
        if isinstance(left, int) and isinstance(right, int):
            _check_int_bits(max(left.bit_length(), right.bit_length()) + 1)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _check_int_bits(left.bit_length() * right)
    elif operator == "%" and isinstance(left, str):
        return printf_size(budget, left, right)
    return None


def _check_int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise ChatTemplateBudgetError(
            f"the chat template computes an integer of about {bits:,} bits; chat templates may "
            f"compute integers of up to {MAX_INT_BITS:,} bits"
        )


# The str (and bytes) methods whose result can be much longer than the string they are called on.
GROWING_STR_METHODS = frozenset(
    {"join", "replace", "center", "ljust", "rjust", "zfill", "expandtabs", "translate"}
)


def str_method_size(budget: RenderBudget, text: str | bytes, name: str, args: tuple) -> int | None:
    """The result's size of ``text.<name>(*args)`` for GROWING_STR_METHODS."""
    if name == "join" and args:
        return budget.size_of(args[0]) + len(text) * max(length(args[0]) - 1, 0)
    if name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str | bytes) and isinstance(new, str | bytes):
            count = text.count(old) if old else len(text) + 1  # type: ignore[arg-type]
            if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
                count = min(count, args[2])
            return len(text) + count * max(len(new) - len(old), 0)
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        return max(len(text), args[0])
    if name == "expandtabs":
        tab_size = args[0] if args and isinstance(args[0], int) else 8
        tabs = text.count("\t") if isinstance(text, str) else text.count(b"\t")
        return len(text) + tabs * max(tab_size, 0)
    if name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((budget.size_of(v) for v in args[0].values()), default=1)
        return len(text) * max(longest, 1)
    return None


def length(value: object) -> int:
    return len(value) if isinstance(value, Sized) else 0


def materialized(value: Any) -> Any:
    """A one-shot iterator as a list, so that it can be measured and still be used."""
    return list(value) if isinstance(value, Iterator) else value
