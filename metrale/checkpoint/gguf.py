"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

A GGUF file carries everything a checkpoint directory does, in its metadata and tensors. It is
turned into a directory the rest of the engine reads like any other (`gguf_model_dir`):
`config.json` from the `<arch>.*` keys, `tokenizer.json` and `tokenizer_config.json` (with the
chat template) from `tokenizer.*` (`tokenizer/gguf_tokenizer.py`), and `model.gguf`, a link to
the file itself. It lives in Metrale's cache, keyed by the file's path, size and time, so it is
made once. The weights are read from the file: tensors renamed to Hugging Face's names,
dequantized (every type `gguf` dequantizes) and, for llama and mistral, the query and key rows
put back in Hugging Face's rotary order (llama.cpp's converter interleaves them).

Before anything loads, every tensor's name, shape and type is checked against the config, as
for safetensors (`preflight`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale import envs
from metrale.checkpoint import CheckpointError
from metrale.config import ModelConfig
from metrale.distributed.sharding import TensorSlice

if TYPE_CHECKING:
    import numpy as np
    import torch

SUFFIX = ".gguf"
MAGIC = b"GGUF"
LINK_NAME = "model.gguf"
# general.architecture -> (config.json's architectures[0], model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# Architectures whose q/k rows llama.cpp's converter permuted for its rotary layout.
PERMUTED = {"llama", "mistral"}
DEQUANTIZABLE = {
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
}  # fmt: skip
# GGUF tensor names (after `blk.N.`) -> Hugging Face's (after `model.layers.N.`)
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf(path: Path) -> bool:
    return path.suffix == SUFFIX and path.is_file()


def find_gguf(model_dir: Path, name: str | None = None) -> Path | None:
    """The GGUF file of a directory: `name` if given, else the only one (None if none)."""
    if name is not None:
        path = model_dir / name
        if not is_gguf(path):
            found = sorted(p.name for p in model_dir.glob(f"*{SUFFIX}"))
            raise CheckpointError(f"--gguf-file {name}: not in {model_dir} (it holds: {found})")
        return path
    files = sorted(model_dir.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        raise CheckpointError(
            f"{model_dir} holds {len(files)} GGUF files ({', '.join(p.name for p in files)}): "
            f"pick one with --gguf-file NAME"
        )
    return files[0] if files else None


def open_reader(path: Path) -> Any:
    """A `gguf.GGUFReader` of `path` (it maps the file and parses every metadata field; tensor
    data is read only when used). A file that is not GGUF, or is truncated, is a CheckpointError
    naming it."""
    import gguf

    path = Path(path)
    with path.open("rb") as file:
        magic = file.read(len(MAGIC))
    if magic != MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError, IndexError, numpy errors... on a bad file
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}): it is truncated or "
            f"corrupt"
        ) from e


def read_metadata(source: Path | Any) -> dict[str, Any]:
    """Every metadata field of a GGUF file (a path, or a reader of it) as plain Python values."""
    reader = open_reader(source) if isinstance(source, str | Path) else source
    try:
        return {name: field.contents() for name, field in reader.fields.items()}
    except Exception as e:  # a field whose contents do not parse
        raise CheckpointError(f"a GGUF metadata field cannot be read ({e})") from e


def model_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A Hugging Face config.json for a GGUF file's metadata."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"GGUF architecture {arch!r} is not supported: use one of {', '.join(ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(
            "this GGUF scales its rotary frequencies by a tensor (rope_freqs, Llama 3.1's rope "
            "scaling): not supported yet"
        )

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    architecture, model_type = ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(metadata.get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    for name, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if (value := metadata.get(f"tokenizer.ggml.{field}")) is not None:
            config[name] = int(value)
    if arch in ("qwen2",):
        config["attention_bias"] = True
    return config


def hf_name(gguf_name: str) -> str | None:
    """A GGUF tensor's Hugging Face name; None for one the models have no use for."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def gguf_model_dir(path: Path) -> Path:
    """The checkpoint directory made of GGUF file `path` (made on first use, in the cache)."""
    path = path.expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = envs.cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from metrale.tokenizer.gguf_tokenizer import gguf_tokenizer_files

    reader = open_reader(path)  # once: parsing the metadata takes seconds on a real file
    names = {t.name for t in reader.tensors}
    metadata = read_metadata(reader)
    files = {"config.json": model_config(metadata, names), **gguf_tokenizer_files(metadata)}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=".making-"))
    try:
        for name, content in files.items():
            (staging / name).write_text(json.dumps(content, ensure_ascii=False, indent=1))
        os.symlink(path, staging / LINK_NAME)
        staging.rename(out)  # whole or not at all; a concurrent maker's copy is as good
    except OSError:
        if not (out / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def gguf_file_of(model_dir: Path) -> Path | None:
    """The GGUF file a checkpoint directory's weights are read from, if they are."""
    link = model_dir / LINK_NAME
    return link if link.exists() else None


def preflight(gguf_path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Every expected tensor, checked present, of its shape and of a type that dequantizes:
    {Hugging Face name: the reader's tensor}."""
    found = {}
    for tensor in open_reader(gguf_path).tensors:
        if (name := hf_name(tensor.name)) is not None:
            found[name] = tensor
    problems = []
    for name, shape in expected.items():
        tensor = found.get(name)
        if tensor is None:
            problems.append(f"missing tensor {name}")
            continue
        got = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims inner first
        kind = tensor.tensor_type.name
        if got != shape:
            problems.append(
                f"{tensor.name} has shape {list(got)}, the metadata implies {list(shape)}"
            )
        elif kind not in DEQUANTIZABLE:
            problems.append(f"{tensor.name} is {kind}, which cannot be dequantized here")
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointError(f"GGUF {gguf_path} does not match its metadata:\n  {shown}{more}")
    return {name: found[name] for name in expected}


def tensor_types(tensors: dict[str, Any]) -> dict[str, str]:
    """{Hugging Face name: GGUF type name, e.g. Q4_1} of `preflight`'s tensors."""
    return {name: tensor.tensor_type.name for name, tensor in tensors.items()}


def iter_tensors(
    tensors: dict[str, Any],
    config: ModelConfig,
    device: torch.device,
    progress: bool = True,
    raw: frozenset[str] = frozenset(),
    slice_of: Callable[[str], TensorSlice | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checked tensors on `device` in Hugging Face's layout, dequantized to float32; those
    named in `raw` as they are stored instead: uint8 [rows, bytes of a row's blocks].

    With `slice_of` (tensor parallelism), each tensor's part this rank holds, read alone from
    the mapped file where the part falls on the type's blocks (rows always do; a split of the
    columns must be a whole number of blocks), else dequantized whole and then sliced."""
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from tqdm import tqdm

    permuted = config.model_type in PERMUTED
    bar = tqdm(total=len(tensors), desc="Loading GGUF", unit="tensor", disable=not progress)
    with bar:
        for name, tensor in tensors.items():
            part = None if slice_of is None else slice_of(name)
            data, whole_then_slice = tensor.data, None
            if part is not None:
                data = _stored_part(tensor.data, tensor.tensor_type, part)
                if data is None:
                    if name in raw:
                        raise ValueError(
                            f"{name} ({tensor.tensor_type.name}) splits over the "
                            f"tensor-parallel ranks inside its quantized blocks: leave "
                            f"--quantization out or choose another tensor-parallel size"
                        )
                    data, whole_then_slice = tensor.data, part
            if name in raw:
                values = np.array(data, dtype=np.uint8)  # copied out of the mapped file
            else:
                values = dequantize(data, tensor.tensor_type)
                values = np.ascontiguousarray(values, np.float32)
                if not values.flags.writeable:  # an F32 tensor is a view of the mapped file
                    values = values.copy()
            weight = torch.from_numpy(values)
            if whole_then_slice is not None:
                weight = whole_then_slice.of(weight).contiguous()
            projection = name.split(".")[-2]
            if permuted and projection in ("q_proj", "k_proj"):  # block rows are weight rows
                weight = _unpermute(weight, weight.shape[0] // config.head_dim)
            yield name, weight.to(device)
            bar.update()


def _stored_part(data: np.ndarray, tensor_type: Any, part: TensorSlice) -> np.ndarray | None:
    """A slice of a tensor as stored: its rows, or its columns' values or quantized blocks
    (None: the columns split a block)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    end = part.start + part.length
    if part.dim == 0:
        return data[part.start : end]
    if tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return data[:, part.start : end]
    block, size = GGML_QUANT_SIZES[tensor_type]
    if part.start % block or part.length % block:
        return None
    return data[:, part.start // block * size : end // block * size]


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head it interleaves the two rotary halves."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )
