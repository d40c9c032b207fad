"""Metrale: an LLM inference engine and server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from metrale.entrypoints.llm import LLM
    from metrale.outputs import CompletionOutput, Logprob, RequestOutput
    from metrale.sampling_params import SamplingParams

_LAZY = {
    "LLM": "metrale.entrypoints.llm",
    "CompletionOutput": "metrale.outputs",
    "Logprob": "metrale.outputs",
    "RequestOutput": "metrale.outputs",
    "SamplingParams": "metrale.sampling_params",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `import metrale.config` or `met --help` does not load the engine and torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'metrale' has no attribute {name!r}")
