"""Safetensors checkpoints: find the shards, check every tensor before loading, stream them.

The preflight compares the names, shapes and dtypes in the shard headers with what the model
class says a checkpoint of this config holds. It reads headers only, so a wrong or truncated
checkpoint fails in milliseconds with one message naming the file, not minutes into loading.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from metrale.checkpoint import CheckpointError
from metrale.config import MAX_NUM_PARAMETERS
from metrale.distributed.sharding import TensorSlice

logger = logging.getLogger(__name__)

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{index} is not a valid safetensors index ({e}): re-download the checkpoint"
            ) from e
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{index.name} lists shards that are missing from {model_dir}: "
                f"{', '.join(missing)}; re-download the checkpoint"
            )
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no safetensors weights in {model_dir} (expected model.safetensors or "
            f"model.safetensors.index.json); convert .bin checkpoints with transformers first"
        )
    return files


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    tensor_slice = f.get_slice(name)
                    tensors[name] = TensorInfo(
                        path, tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
                    )
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(
                f"{path} is not a readable safetensors file ({e}); the shard is corrupt or "
                f"truncated: re-download it"
            ) from e
    return tensors


def preflight(model_dir: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, TensorInfo]:
    """Check the checkpoint holds every expected tensor, with the right shape and a float dtype."""
    found = read_headers(safetensors_files(model_dir))
    problems = []
    for name, shape in expected.items():
        info = found.get(name)
        if info is None:
            problems.append(f"missing tensor {name}")
        elif info.shape != shape:
            problems.append(
                f"{name} in {info.file.name} has shape {list(info.shape)}, "
                f"config.json implies {list(shape)}"
            )
        elif info.dtype not in FLOAT_DTYPES:
            problems.append(
                f"{name} in {info.file.name} has dtype {info.dtype}; only F32, F16 and BF16 "
                f"checkpoints load (quantized formats are not supported yet)"
            )
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointError(
            f"checkpoint {model_dir} does not match its config.json:\n  {shown}{more}\n"
            f"the weights and config.json come from different models, or a download is "
            f"incomplete"
        )
    unused = sorted(name for name in found if name not in expected and not _derived(name))
    if unused:  # the model would run without them: say so, they may be weights it lacks
        logger.warning(
            "checkpoint %s holds %d tensor(s) the model does not load, which it runs without: %s%s",
            model_dir,
            len(unused),
            ", ".join(unused[:5]),
            " ..." if len(unused) > 5 else "",
        )
    return {name: found[name] for name in expected}


# Tensors some checkpoints carry that the model recomputes or shares: never a lost weight.
DERIVED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _derived(name: str) -> bool:
    # (a tied head's copy of the embedding: the model reads the embedding)
    return name.endswith(DERIVED_SUFFIXES) or name == "lm_head.weight"


def iter_checkpoint_tensors(
    tensors: dict[str, TensorInfo],
    device: torch.device,
    progress: bool = True,
    slice_of: Callable[[str], TensorSlice | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor, read from its shard onto `device`. `slice_of(name)`: the part of it this
    tensor-parallel rank holds (None: all); only that part is read from the file."""
    by_file: dict[Path, list[str]] = {}
    for name, info in tensors.items():
        by_file.setdefault(info.file, []).append(name)
    bar = tqdm(total=len(tensors), desc="Loading weights", unit="tensor", disable=not progress)
    with bar:
        for path, names in by_file.items():
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in names:
                    part = None if slice_of is None else slice_of(name)
                    if part is None:
                        yield name, f.get_tensor(name)
                    else:
                        index = part.index(len(tensors[name].shape))
                        yield name, f.get_slice(name)[index].to(device)
                    bar.update()


def sliced_shapes(
    shapes: dict[str, tuple[int, ...]], slice_of: Callable[[str], TensorSlice | None]
) -> dict[str, tuple[int, ...]]:
    """The shapes of the parts of each tensor one tensor-parallel rank holds."""
    return {
        name: shape if (part := slice_of(name)) is None else part.shape_of(shape)
        for name, shape in shapes.items()
    }


def iter_dummy_tensors(
    expected: dict[str, tuple[int, ...]],
    device: torch.device,
    seed: int = 0,
    scale: float = 0.02,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights of the checkpoint's shapes, drawn on `device`, for benchmarks and the demo.

    Norm weights are ones, as a trained model's are near one; everything else is normal noise.
    The shapes come from a checked config.json; their total is checked again here, before the
    first tensor, so that no config built around that check can ask for an absurd allocation.
    """
    num_parameters = sum(math.prod(shape) for shape in expected.values())
    if num_parameters > MAX_NUM_PARAMETERS:
        raise CheckpointError(
            f"the model's shapes hold {num_parameters:,} parameters, above "
            f"{MAX_NUM_PARAMETERS:,}: its config is corrupt, no dummy weights drawn"
        )
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in expected.items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
        else:
            yield name, torch.randn(shape, generator=generator, device=device).mul_(scale)
