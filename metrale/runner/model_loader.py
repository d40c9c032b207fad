"""Build a model of the checkpoint's architecture on the device and fill in its weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from metrale.checkpoint.weights import iter_checkpoint_tensors, iter_dummy_tensors, preflight
from metrale.config import ModelConfig
from metrale.models import model_class_for

LOAD_FORMATS = ("safetensors", "dummy")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "safetensors",
    seed: int = 0,
    progress: bool = True,
    fused_kernels: bool = False,
) -> nn.Module:
    """The model, in eval mode on `device`; `dummy` fills random weights of the right shapes."""
    cls = model_class_for(config.architecture)
    expected = cls.checkpoint_shapes(config)
    if load_format == "safetensors":
        tensors = iter_checkpoint_tensors(preflight(model_dir, expected), device, progress)
    elif load_format == "dummy":
        tensors = iter_dummy_tensors(expected, device, seed=seed)
    else:
        raise ValueError(f"load_format={load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
    with _default_dtype(dtype), torch.device(device):
        model = cls(config, fused_kernels=fused_kernels)
    model.load_weights(tensors)
    return model.eval().requires_grad_(False)
