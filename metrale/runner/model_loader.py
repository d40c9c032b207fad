"""Build a model of the checkpoint's architecture on the device and fill in its weights."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from metrale.checkpoint import gguf
from metrale.checkpoint.weights import (
    iter_checkpoint_tensors,
    iter_dummy_tensors,
    preflight,
    sliced_shapes,
)
from metrale.config import ModelConfig
from metrale.kernels.quant_layout import FORMATS as PACKED_FORMATS
from metrale.layers.linear import Linear, prepack_for_cpu
from metrale.layers.packed_weight import PackedWeight
from metrale.models import model_class_for

logger = logging.getLogger(__name__)

# auto: the GGUF file a directory was made of (checkpoint/gguf.py), else its safetensors.
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# gguf: linear weights stored in a format the quantized kernels read stay packed.
QUANTIZATIONS = (None, "gguf")


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


def preflight_model(model_dir: Path, load_format: str) -> None:
    """The checkpoint's tensors against the shapes its config.json declares (every rank's),
    before anything loads: what `met serve` checks before it waits on the engine."""
    config = ModelConfig.from_dir(model_dir)
    shapes = model_class_for(config.architecture).checkpoint_shapes(config)
    preflight_checkpoint(model_dir, load_format, shapes)


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
    quantization: str | None = None,
    seed: int = 0,
    progress: bool = True,
    fused_kernels: bool = False,
    keep_dense_weights: bool = False,
) -> nn.Module:
    """The model, in eval mode on `device`; `dummy` fills random weights of the right shapes.

    quantization="gguf": the linear layers whose GGUF weights are Q8_0, Q4_0 or Q4_1 keep them
    packed (`PackedWeight`); every other tensor is dequantized to `dtype` as by default. On a
    CPU the linear layers get their products' layout (`prepack_for_cpu`: Metrale's panels or
    oneDNN's), and with `keep_dense_weights` keep the dense one too (compiled decode steps read
    it)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: use gguf or leave it out")
    cls = model_class_for(config.architecture)
    expected = cls.checkpoint_shapes(config)
    kind = weights_format(model_dir, load_format)
    if quantization == "gguf" and kind != "gguf":
        raise ValueError(
            f"--quantization gguf keeps a GGUF file's weights packed; {model_dir} loads as {kind}"
        )
    checked = {} if kind == "dummy" else preflight_checkpoint(model_dir, kind, expected)
    with _default_dtype(dtype), torch.device(device):
        model = cls(config, fused_kernels=fused_kernels)
    # Under tensor parallelism each rank reads only its part of each tensor.
    slice_of = model.weight_slice if config.tensor_parallel_size > 1 else None
    tensors: Iterable[tuple[str, torch.Tensor | PackedWeight]]
    if kind == "dummy":
        shapes = expected if slice_of is None else sliced_shapes(expected, slice_of)
        tensors = iter_dummy_tensors(shapes, device, seed=seed)
    elif kind == "gguf":
        types = gguf.tensor_types(checked)
        packed = pack_linears(model, types) if quantization == "gguf" else frozenset()
        raw = gguf.iter_tensors(checked, config, device, progress, packed, slice_of)
        tensors = (
            (name, PackedWeight.from_ggml(types[name], t) if name in packed else t)
            for name, t in raw
        )
    else:
        tensors = iter_checkpoint_tensors(checked, device, progress, slice_of)  # type: ignore[arg-type]
    model.load_weights(tensors)
    if kind == "gguf" and keep_dense_weights and quantization is None:
        copies = load_decode_packed(model, checked, config, device)
        logger.info("one-row decode steps read %d linear layers' GGUF blocks packed", copies)
    if device.type == "cpu":
        packed = prepack_for_cpu(model, keep_dense=keep_dense_weights)
        logger.debug("%d linear layers packed for their CPU products", packed)
    return model.eval().requires_grad_(False)


def linear_shards(model: nn.Module, types: dict[str, str]) -> dict[str, list[str]]:
    """{linear layer: the checkpoint tensors that fill its weight} (one, or the shards of a
    fused matrix), for the tensors in `types` ({checkpoint name: GGUF type})."""
    shards: dict[str, list[str]] = defaultdict(list)
    for name in types:
        target, _ = model.weight_target(name)  # type: ignore[operator]
        module_name, _, kind = target.rpartition(".")
        if kind == "weight" and isinstance(model.get_submodule(module_name), Linear):
            shards[module_name].append(name)
    return dict(shards)


def _one_format(names: list[str], types: dict[str, str]) -> str | None:
    """The packable format all of a layer's tensors share, else None."""
    formats = {types[name] for name in names}
    fmt = formats.pop() if len(formats) == 1 else None
    return fmt if fmt in PACKED_FORMATS else None


def pack_linears(model: nn.Module, types: dict[str, str]) -> frozenset[str]:
    """Pack every linear layer whose checkpoint weights share one packable type; the names of
    the checkpoint tensors that now load packed."""
    packed: list[str] = []
    kept: Counter[str] = Counter()
    shards = linear_shards(model, types)
    for module_name, names in shards.items():
        fmt = _one_format(names, types)
        if fmt is not None:
            model.get_submodule(module_name).pack_(fmt)
            packed += names
        else:
            kept["+".join(sorted({types[name] for name in names}))] += 1
    logger.info(
        "--quantization gguf: %d linear layers packed, %d dequantized%s",
        len(shards) - sum(kept.values()),
        sum(kept.values()),
        f" ({', '.join(f'{n} of {t}' for t, n in kept.items())})" if kept else "",
    )
    return frozenset(packed)


def load_decode_packed(
    model: nn.Module, checked: dict[str, object], config: ModelConfig, device: torch.device
) -> int:
    """Give each dense linear layer of a model loaded from a GGUF file, whose tensors share one
    packable type, the file's blocks of its weight as `decode_packed` (a tied head: the
    embedding's), which compiled one-row CPU decode steps read: Q4_1 is 0.625 bytes a value
    where float32 is 4. The number of layers given one (0 where the kernel that reads them
    cannot be built)."""
    from metrale.kernels import cpu_extension

    types = gguf.tensor_types(checked)
    targets: dict[str, list[tuple[Linear, int]]] = defaultdict(list)
    layers: dict[str, tuple[Linear, str]] = {}
    for module_name, names in linear_shards(model, types).items():
        fmt = _one_format(names, types)
        if fmt is not None:
            layers[module_name] = (model.get_submodule(module_name), fmt)
            for name in names:
                _, first_row = model.weight_target(name)  # type: ignore[operator]
                targets[name].append((layers[module_name][0], first_row or 0))
    embedding = "model.embed_tokens.weight"
    head = getattr(model, "lm_head", None)
    if (
        config.tie_word_embeddings
        and isinstance(head, Linear)
        and types.get(embedding) in PACKED_FORMATS
    ):
        layers["lm_head"] = (head, types[embedding])
        targets[embedding].append((head, 0))
    if not layers or not cpu_extension.enabled():
        return 0
    for layer, fmt in layers.values():
        layer.decode_packed = PackedWeight.empty(fmt, layer.out_features, layer.in_features, device)
    wanted = {name: checked[name] for name in targets}
    for name, blocks in gguf.iter_tensors(wanted, config, device, False, frozenset(wanted)):
        packed = PackedWeight.from_ggml(types[name], blocks)
        for layer, first_row in targets[name]:
            layer.decode_packed.copy_rows_(first_row, packed)
    return len(layers)
