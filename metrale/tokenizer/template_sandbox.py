"""The sandbox chat templates compile and render in: jinja2's, closed where it leaves gaps.

A checkpoint's chat template is untrusted code. jinja2's immutable sandbox keeps it from
reaching Python internals (underscore attributes, mutating methods); `TemplateSandbox` adds:

- no ``include``, ``import``, ``from`` or ``extends``: a template is one file that reads nothing;
- a deadline per render: the clock is read at every loop iteration, call, filter, operator and
  output chunk, so a loop that outputs nothing is stopped too; and a call-depth limit for
  recursive macros;
- a size budget per render for the output and for every value the template builds: each
  operation that can multiply sizes (``*``, ``+``, ``%``, ``~``, ``str.format``, ``join``,
  ``replace``, widths and paddings, list and dict literals that share sub-lists) is checked on
  an estimate of its result before it runs;
- ``range`` keeps jinja2's cap of MAX_RANGE items, refused with a ChatTemplateError;
- only data turns into text: no function's or object's repr reaches the prompt.

Every refusal is a ChatTemplateError subclass whose message names the rule or budget; the
server answers it with a 400. The budget itself lives in `template_budget.py`.
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2 import nodes
from jinja2.runtime import Context, Undefined
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.visitor import NodeTransformer
from markupsafe import EscapeFormatter, Markup

from metrale.tokenizer.template_budget import (
    GROWING_STR_METHODS,
    ChatTemplateBudgetError,
    ChatTemplateError,
    ChatTemplateSecurityError,
    RenderBudget,
    RenderLimits,
    active_budget,
    binop_size,
    current_budget,
    materialized,
    require_printable,
    str_method_size,
)
from metrale.tokenizer.template_filters import guarded_filters

# --- globals ----------------------------------------------------------------------------------


class _TemplateDict:
    """The template's ``dict``: the builtin's constructors without access to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A ``namespace()`` that refuses underscore names, which the sandbox does not check on set."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Positional self, as in jinja2's Namespace, so that namespace(self=...) still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise ChatTemplateSecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


def _raise_exception(message: str) -> None:
    require_printable(message)
    raise ChatTemplateError(f"chat template rejected the conversation: {message}")


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _range(*args: int) -> range:
    """jinja2's sandboxed range: at most MAX_RANGE items, refused with a ChatTemplateError."""
    numbers = range(*args)
    try:
        num_items = len(numbers)
    except OverflowError:  # more items than a C size
        num_items = MAX_RANGE + 1
    if num_items > MAX_RANGE:
        raise ChatTemplateBudgetError(
            f"range({', '.join(map(str, args))}) has {num_items:,} items or more; chat "
            f"templates may build ranges of at most {MAX_RANGE:,}"
        )
    return numbers


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if isinstance(n, int) and isinstance(max, int):  # up to 12 characters a word
        current_budget().check_size(n * max * 12, f"lipsum({n}, max={max})")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


# --- the rewrite of the template's syntax tree ------------------------------------------------


def _loop_items(iterable: Any) -> _TimedIterable:
    """What a ``{% for %}`` loop iterates: the same items, with the clock read at each one."""
    return _TimedIterable(iterable, current_budget())


class _TimedIterable:
    __slots__ = ("_budget", "_iterable")

    def __init__(self, iterable: Any, budget: RenderBudget) -> None:
        self._iterable = iterable
        self._budget = budget

    def __iter__(self) -> Iterator[Any]:
        check_time = self._budget.check_time
        for item in self._iterable:
            check_time()
            yield item

    def __len__(self) -> int:  # loop.length without consuming the items, as before
        return len(self._iterable)


def _concat(*values: Any) -> str:
    """The ``~`` operator, its size checked before the text is built."""
    budget = current_budget()
    size = 0
    for value in values:
        require_printable(value)
        size += budget.size_of(value)
        budget.check_size(size, "a ~ concatenation")
    return "".join([str(value) for value in values])


def _literal(value: Any) -> Any:
    """A list, tuple or dict literal, its size checked: ``[x, x]`` doubles the text of x."""
    current_budget().check_value(value, "a literal")
    return value


def _imported(function: Callable[..., Any], args: list[nodes.Expr], lineno: int) -> nodes.Call:
    """A call of one of this module's guards; the compiled template imports it by name, so the
    template itself cannot name or reach it."""
    name = nodes.ImportedName(f"{__name__}.{function.__name__}", lineno=lineno)
    return nodes.Call(name, args, [], None, None, lineno=lineno)


class _GuardRewriter(NodeTransformer):
    """Refuses nodes that read other templates; routes loops, ``~`` and literals via guards."""

    _REFUSED: ClassVar[dict[type[nodes.Node], str]] = {
        nodes.Include: "include",
        nodes.Import: "import",
        nodes.FromImport: "from ... import",
        nodes.Extends: "extends",
    }

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def generic_visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> nodes.Node:
        for node_type, tag in self._REFUSED.items():
            if isinstance(node, node_type):
                raise ChatTemplateSecurityError(
                    f"chat template from {self.origin} uses {{% {tag} %}} on line {node.lineno}: "
                    "chat templates cannot read other templates or files; inline what it needs"
                )
        return super().generic_visit(node, *args, **kwargs)

    def visit_Name(self, node: nodes.Name) -> nodes.Node:
        # `self.block()` renders a block again, joined outside any budget; chat templates have
        # no use for it (blocks matter only to inheritance, which is refused above).
        if node.name == "self" and node.ctx == "load":
            raise ChatTemplateSecurityError(
                f"chat template from {self.origin} uses `self` on line {node.lineno}: chat "
                "templates cannot render their blocks again"
            )
        return node

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _imported(_loop_items, [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _imported(_concat, list(node.nodes), node.lineno)

    def visit_List(self, node: nodes.List) -> nodes.Node:
        self.generic_visit(node)
        return _imported(_literal, [node], node.lineno)

    visit_Dict = visit_List

    def visit_Tuple(self, node: nodes.Tuple) -> nodes.Node:
        self.generic_visit(node)
        if node.ctx != "load":  # an assignment or loop target
            return node
        return _imported(_literal, [node], node.lineno)


# --- the environment --------------------------------------------------------------------------


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` for templates: each field's width and result counted against the budget."""

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        require_printable(value)  # before !r or !s turns it into text
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        require_printable(value)
        budget = current_budget()
        widths = sum(int(number) for number in re.findall(r"\d+", format_spec))
        budget.check_size(self._size + budget.size_of(value) + widths, "str.format's result")
        text = super().format_field(value, format_spec)
        self._size += len(text)
        return text


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


class TemplateSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with Hugging Face's template globals and a budget per render.

    Fails loudly where jinja2 would render an unsafe attribute as empty: a template that
    reaches for ``__globals__`` is hostile or broken, and either way the request should fail
    rather than render a prompt with a silent hole in it.
    """

    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self, limits: RenderLimits | None = None) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
            autoescape=False,
            finalize=_printable,
        )
        self.limits = limits or RenderLimits()
        self.filters = guarded_filters(self.filters)
        self.globals.update(
            range=_range,
            lipsum=_lipsum,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            dict=_TemplateDict(),
            namespace=_TemplateNamespace,
        )

    def compile_template(self, text: str, origin: str) -> jinja2.Template:
        """Parse, refuse and rewrite, compile: every failure is a ChatTemplateError."""
        if len(text) > self.limits.max_template_chars:
            raise ChatTemplateBudgetError(
                f"chat template from {origin} has {len(text):,} characters; chat templates may "
                f"have at most {self.limits.max_template_chars:,}"
            )
        try:
            with active_budget(RenderBudget(self.limits)):
                tree = self.parse(text)
                tree = _GuardRewriter(origin).visit(tree)
                tree.set_environment(self)
                return self.from_string(tree)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(
                f"chat template from {origin} has a syntax error on line {error.lineno}: "
                f"{error.message}; fix it or pass --chat-template FILE"
            ) from error
        except (RecursionError, MemoryError, SyntaxError) as error:
            raise ChatTemplateBudgetError(
                f"chat template from {origin} is too large or nests too deeply to compile "
                f"({type(error).__name__}); fix it or pass --chat-template FILE"
            ) from error

    def render_template(
        self, template: jinja2.Template, variables: Mapping[str, Any], origin: str
    ) -> str:
        """Render within this sandbox's limits; every failure is a ChatTemplateError.

        The output is counted chunk by chunk as jinja2 generates it, so that the render stops
        as soon as it passes the budget.
        """
        budget = RenderBudget(self.limits)
        chunks: list[str] = []
        try:
            with active_budget(budget):
                budget.scale_to_input(variables)
                for chunk in template.generate(**variables):
                    budget.add_output(chunk)
                    chunks.append(chunk)
        except ChatTemplateError:
            raise
        except RecursionError as error:
            raise ChatTemplateBudgetError(
                f"chat template from {origin} recursed too deeply (a macro recursing without end?)"
            ) from error
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template from {origin} failed: {error}") from error
        except Exception as error:  # the template's own bug: a TypeError, a division by zero
            raise ChatTemplateError(
                f"chat template from {origin} failed: {type(error).__name__}: {error}"
            ) from error
        return "".join(chunks)

    # jinja2's hooks ---------------------------------------------------------------------------

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        raise ChatTemplateSecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe; "
            "chat templates cannot reach Python internals"
        )

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.check_time()
        if isinstance(obj, types.BuiltinMethodType) and isinstance(
            obj.__self__, str | bytes | int | float
        ):
            obj, args = self._checked_builtin_method(budget, obj, args, kwargs)
        budget.enter_call()
        try:
            result = super().call(context, obj, *args, **kwargs)
        finally:
            budget.exit_call()
        budget.check_value(result, "a call's result")
        return result

    def _checked_builtin_method(
        self, budget: RenderBudget, method: Any, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[Any, tuple]:
        """A method of a str, bytes or number, checked before it runs.

        Their integer arguments are widths, lengths and counts (``ljust``, ``zfill``,
        ``to_bytes``): none may exceed the size budget. A raw ``str.format`` (reached around
        attribute lookup, as older jinja2's ``attr`` filter did) gets the sandboxed formatter.
        """
        name, value = method.__name__, method.__self__
        for argument in (*args, *kwargs.values()):
            if isinstance(argument, int) and not isinstance(argument, bool):
                budget.check_size(abs(argument), f"{type(value).__name__}.{name}({argument:,})")
        if name in ("format", "format_map") and isinstance(value, str):
            return self.wrap_str_format(method), args
        if name in GROWING_STR_METHODS and isinstance(value, str | bytes):
            if name == "join" and args:
                args = (materialized(args[0]), *args[1:])
            size = str_method_size(budget, value, name, args)
            if size is not None:
                budget.check_size(size, f"str.{name}'s result")
        return method, args

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = current_budget()
        budget.check_time()
        size = binop_size(budget, operator, left, right)
        if size is None:
            return self.binop_table[operator](left, right)
        budget.check_size(size, f"the result of {operator}")
        result = self.binop_table[operator](left, right)
        budget.remember_size(result, size)  # so that doubling a list in a loop stays linear
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        is_method = isinstance(value, types.MethodType | types.BuiltinMethodType)
        if not is_method or value.__name__ not in ("format", "format_map"):
            return None
        text = value.__self__
        if not isinstance(text, str):
            return None
        formatter: _BoundedFormatter
        if isinstance(text, Markup):
            formatter = _BoundedEscapeFormatter(self, escape=text.escape)
        else:
            formatter = _BoundedFormatter(self)
        is_format_map = value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                args, kwargs = (), args[0]
            return type(text)(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(wrapper, value)

    @staticmethod
    def concat(parts: Iterable[str]) -> str:  # type: ignore[override]
        """Joins the output of a block (a macro's, a ``{% set %}`` block's) within the budget."""
        parts = parts if isinstance(parts, list) else list(parts)
        current_budget().check_size(sum(map(len, parts)), "a block's output")
        return "".join(parts)


def _printable(value: Any) -> Any:
    """Each ``{{ }}`` value: data only (no object reprs), its text within the budget."""
    if isinstance(value, str):
        return value
    require_printable(value)
    budget = current_budget()
    budget.check_size(budget.output_bytes + budget.size_of(value), "the chat template's output")
    return value


__all__ = [
    "MAX_RANGE",
    "ChatTemplateBudgetError",
    "ChatTemplateError",
    "ChatTemplateSecurityError",
    "RenderLimits",
    "TemplateSandbox",
]
