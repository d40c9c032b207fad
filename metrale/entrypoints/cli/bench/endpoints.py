"""One streamed request to an OpenAI- or Anthropic-compatible server, timed as `metrics` defines.

Each endpoint knows its body and where a server-sent event carries output and the output-token
count. A chunk counts as output when it carries text, reasoning or tool-call arguments; a
server's opening chunk (the role, `message_start`) and its closing one (the finish reason, the
usage) do not, so TTFT means the first generated text on every server alike.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from metrale.entrypoints.cli.bench.datasets import Sample
from metrale.entrypoints.cli.bench.metrics import RequestResult

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")


@dataclass(frozen=True)
class RequestSettings:
    model: str
    ignore_eos: bool = False
    temperature: float | None = 0.0  # None: the server's default
    extra_body: dict[str, Any] | None = None  # merged into every body (e.g. min_tokens)


def request_body(endpoint: str, sample: Sample, settings: RequestSettings) -> dict[str, Any]:
    body: dict[str, Any] = {"model": settings.model, "stream": True}
    if endpoint == "/v1/completions":
        body |= {"prompt": sample.prompt, "max_tokens": sample.output_len}
    elif endpoint == "/v1/chat/completions":
        body |= {
            "messages": [{"role": "user", "content": sample.prompt}],
            "max_completion_tokens": sample.output_len,
        }
    elif endpoint == "/v1/messages":
        body |= {
            "messages": [{"role": "user", "content": sample.prompt}],
            "max_tokens": sample.output_len,
        }
    else:
        raise ValueError(f"--endpoint {endpoint}: use one of {', '.join(ENDPOINTS)}")
    if endpoint != "/v1/messages":
        body["stream_options"] = {"include_usage": True}
    if settings.temperature is not None:
        body["temperature"] = settings.temperature
    if settings.ignore_eos:
        body["ignore_eos"] = True
    return body | (settings.extra_body or {})


def read_event(endpoint: str, event: dict[str, Any]) -> tuple[str | None, int | None]:
    """The output text an event carries (None: not an output chunk) and the output-token count
    it reports (None: none)."""
    usage = event.get("usage") if isinstance(event.get("usage"), dict) else None
    if endpoint == "/v1/messages":
        kind = event.get("type")
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            text = delta.get("text") or delta.get("thinking") or delta.get("partial_json")
            return text or None, None
        if kind == "message_delta" and usage is not None:
            return None, usage.get("output_tokens")
        return None, None
    tokens = usage.get("completion_tokens") if usage is not None else None
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None, tokens
    choice = choices[0]
    if endpoint == "/v1/completions":
        return choice.get("text") or None, tokens
    delta = choice.get("delta") or {}
    parts = [delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning")]
    for call in delta.get("tool_calls") or []:
        function = call.get("function") or {} if isinstance(call, dict) else {}
        parts.append(function.get("arguments") or function.get("name"))
    return "".join(p for p in parts if isinstance(p, str)) or None, tokens


async def send(
    client: httpx.AsyncClient, endpoint: str, sample: Sample, settings: RequestSettings
) -> RequestResult:
    """Stream one request; failures (HTTP errors, broken streams, no output) are results too."""
    result = RequestResult(prompt_len=sample.prompt_len)
    body = request_body(endpoint, sample, settings)
    start = result.start_time = time.perf_counter()
    last = start
    text: list[str] = []
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if not data or data == "[DONE]":
                    continue
                event = json.loads(data)
                if not isinstance(event, dict):
                    continue
                if "error" in event and not event.get("choices"):
                    result.error = f"error event: {json.dumps(event['error'])[:300]}"
                    return result
                chunk, tokens = read_event(endpoint, event)
                if tokens is not None:
                    result.output_tokens = tokens
                if chunk is None:
                    continue
                now = time.perf_counter()
                if not text:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                text.append(chunk)
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.generated_text = "".join(text)
    result.latency = last - start
    result.success = bool(text)
    if not text:
        result.error = "the stream ended without output"
    return result
