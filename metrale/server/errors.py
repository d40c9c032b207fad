"""Errors in the OpenAI shape, and a body parser that never lets a framework answer for us.

Every failure a client can cause — bytes that are not UTF-8, text that is not JSON, nesting too
deep to parse, text that is not valid Unicode (a lone surrogate escape), integers past int64,
numbers that are not finite, fields of the wrong type or out of range — becomes a 4xx whose body
is `{"error": {"message", "type", "param", "code"}}`, the shape the OpenAI SDKs read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, TypeVar

import pydantic
from fastapi import Request

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)

MAX_JSON_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class APIError(Exception):
    """An error answered to the client; `status` 4xx for its mistakes, 5xx for ours."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
        anthropic_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type or _default_type(status)
        self.headers = dict(headers or {})
        # Anthropic answers some situations with a status of its own (529 when overloaded).
        self.anthropic_status = anthropic_status or status

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 408:
        return "timeout_error"
    if status == 501:
        return "not_implemented_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def model_not_found(name: str) -> APIError:
    return APIError(
        f"The model `{name}` does not exist.",
        404,
        param="model",
        code="model_not_found",
        error_type="invalid_request_error",
    )


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    raw = await request.body()  # the body-size limit is the edge middleware's
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(
            f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise APIError("request body is nested too deeply") from None
    check_json_values(data)
    if not isinstance(data, dict):
        raise APIError(f"request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None
    except ValueError as e:  # a model validator's own check
        raise APIError(str(e)) from None


def validation_error(e: pydantic.ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    # For a value that fits no member of a union, the member that got furthest into the value
    # has the most useful complaint ("messages.0.content.0.type: Field required" beats
    # "messages.0.content: Input should be a valid string").
    first = max(errors, key=lambda err: len(err["loc"]))
    param = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part)) or None
    message = first["msg"].removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    return APIError(message, 400, param=param)


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member it tried in `loc` (`str`, `list[ContentPart]`, ...)."""
    return isinstance(part, str) and (
        "[" in part
        or part in {"str", "int", "float", "bool", "dict", "list", "none"}
        or part.startswith(("constrained-", "function-"))
    )


def check_json_values(value: object) -> None:
    """Refuse what JSON can carry but nothing downstream should meet: nesting past
    `MAX_JSON_DEPTH`, strings with lone surrogates (`"\\ud800"` parses, but is no Unicode text
    and cannot be encoded), integers past int64 and non-finite numbers (`NaN`, `Infinity`).
    Iterative, so a hostile body cannot exhaust the stack here either. The scalars of a
    container are checked where they lie, their path built only for an error (a prompt of
    token ids is a long list of them)."""
    if not isinstance(value, dict | list):
        _check_scalar(value, ())
        return
    stack: list[tuple[dict | list, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if len(path) + (1 if item else 0) >= MAX_JSON_DEPTH:  # it, or what it holds
            raise APIError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in children:
            if isinstance(key, str) and not key.isascii():
                _check_unicode(key, path)
            if isinstance(child, dict | list):
                stack.append((child, (*path, key)))
            elif not _scalar_ok(child):
                _check_scalar(child, (*path, key))


def _scalar_ok(value: object) -> bool:
    """True for what needs no closer look: ASCII strings, booleans, None, int64 integers and
    finite floats (bool is an int: its range check passes)."""
    kind = type(value)
    if kind is int:
        return INT64_MIN <= value <= INT64_MAX  # type: ignore[operator]
    if kind is str:
        return value.isascii()  # type: ignore[union-attr]
    if kind is float:
        return math.isfinite(value)  # type: ignore[arg-type]
    return value is None or kind is bool


def _check_scalar(value: object, path: tuple[str | int, ...]) -> None:
    if isinstance(value, str):
        if not value.isascii():
            _check_unicode(value, path)
    elif isinstance(value, bool):
        return
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise _value_error(path, "integer is out of range (past 64 bits)")
    elif isinstance(value, float) and not math.isfinite(value):
        raise _value_error(path, f"{value} is not a finite number")


def _check_unicode(text: str, path: tuple[str | int, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        reason = f"string is not valid Unicode (a lone surrogate at character {e.start})"
        raise _value_error(path, reason) from None


def _value_error(path: tuple[str | int, ...], reason: str) -> APIError:
    param = ".".join(_ascii(part) for part in path) or None
    return APIError(f"{param}: {reason}" if param else reason, param=param)


def _ascii(part: str | int) -> str:
    return part.encode("utf-8", "backslashreplace").decode() if isinstance(part, str) else str(part)


def http_status_error(status: int, detail: str | None = None) -> APIError:
    phrase = HTTPStatus(status).phrase
    return APIError(detail or phrase, status)
