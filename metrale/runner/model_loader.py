"""Build a model of the checkpoint's architecture on the device and fill in its weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from metrale.checkpoint import gguf
from metrale.checkpoint.weights import iter_checkpoint_tensors, iter_dummy_tensors, preflight
from metrale.config import ModelConfig
from metrale.models import model_class_for

# auto: the GGUF file a directory was made of (checkpoint/gguf.py), else its safetensors.
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def weights_format(model_dir: Path, load_format: str) -> str:
    """What `load_format` means for `model_dir`: safetensors, gguf or dummy."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
    if load_format == "auto":
        return "gguf" if gguf.gguf_file_of(model_dir) is not None else "safetensors"
    return load_format


def preflight_checkpoint(
    model_dir: Path, load_format: str, expected: dict[str, tuple[int, ...]]
) -> dict[str, object]:
    """Check the checkpoint's tensors against `expected` before anything loads."""
    kind = weights_format(model_dir, load_format)
    if kind == "gguf":
        path = gguf.gguf_file_of(model_dir)
        if path is None:
            raise ValueError(f"--load-format gguf: {model_dir} was not made from a GGUF file")
        return gguf.preflight(path, expected)
    if kind == "safetensors":
        return preflight(model_dir, expected)  # type: ignore[return-value]
    return {}


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
    load_format: str = "auto",
    seed: int = 0,
    progress: bool = True,
    fused_kernels: bool = False,
) -> nn.Module:
    """The model, in eval mode on `device`; `dummy` fills random weights of the right shapes."""
    cls = model_class_for(config.architecture)
    expected = cls.checkpoint_shapes(config)
    kind = weights_format(model_dir, load_format)
    if kind == "dummy":
        tensors = iter_dummy_tensors(expected, device, seed=seed)
    else:
        checked = preflight_checkpoint(model_dir, kind, expected)
        if kind == "gguf":
            tensors = gguf.iter_tensors(checked, config, device, progress)
        else:
            tensors = iter_checkpoint_tensors(checked, device, progress)  # type: ignore[arg-type]
    with _default_dtype(dtype), torch.device(device):
        model = cls(config, fused_kernels=fused_kernels)
    model.load_weights(tensors)
    return model.eval().requires_grad_(False)
