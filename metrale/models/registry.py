"""Architecture name -> model class. A new model family registers itself here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

ModelT = TypeVar("ModelT", bound=type[nn.Module])

_REGISTRY: dict[str, type[nn.Module]] = {}


def register_model(*architectures: str) -> Callable[[ModelT], ModelT]:
    def decorate(cls: ModelT) -> ModelT:
        for name in architectures:
            _REGISTRY[name] = cls
        return cls

    return decorate


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class_for(architecture: str) -> type[nn.Module]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} (config.json `architectures`) is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        ) from None
