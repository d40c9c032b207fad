"""Configuration: one frozen dataclass per concern, resolved once at startup.

`ModelConfig` is what the engine needs from a checkpoint's `config.json`, parsed into plain fields
so no code downstream reads the raw dict. `CacheConfig` and `SchedulerConfig` come from engine
flags (`EngineArgs`). Every derived value is computed here, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        allowed = ", ".join(sorted({"float32", "float16", "bfloat16"}))
        raise ValueError(f"dtype={name!r} is not supported: use one of {allowed} or auto") from None


# fp8 caches store each key and value as it is (scale 1, as vLLM without calibrated scales),
# saturated to the format's largest finite value: half the bytes of bf16 to read every step.
_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_NAMES = ("auto", *_KV_CACHE_DTYPES)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: `auto` stores keys and values in the model's dtype."""
    if name == "auto":
        return model_dtype
    try:
        return _KV_CACHE_DTYPES[name]
    except KeyError:
        allowed = ", ".join(KV_CACHE_DTYPE_NAMES)
        raise ValueError(
            f"kv_cache_dtype={name!r} is not supported: use one of {allowed}"
        ) from None


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, in the Hugging Face `rope_parameters` vocabulary."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    SUPPORTED = ("default", "linear", "llama3")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters`; older checkpoints write `rope_theta` plus an
        # optional `rope_scaling` dict whose type key is `rope_type` or, older still, `type`.
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in cls.SUPPORTED:
            raise ValueError(
                f"rope_type={rope_type!r} in config.json is not supported yet "
                f"(supported: {', '.join(cls.SUPPORTED)})"
            )
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a decoder-only transformer checkpoint."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: a model directory needs the checkpoint's config.json"
            )
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e}): re-download the checkpoint") from e
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ValueError(f"{source} names no `architectures`: cannot tell which model to build")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden_size = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            # Qwen2 checkpoints carry a `sliding_window` they do not use unless told to.
            sliding_window = raw.get("sliding_window")
            if raw.get("use_sliding_window") is False:
                sliding_window = None
            return cls(
                architecture=architectures[0],
                model_type=raw.get("model_type", ""),
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                sliding_window=int(sliding_window) if sliding_window else None,
                dtype=parse_dtype(str(raw.get("torch_dtype") or raw.get("dtype") or "float32")),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ValueError(
                f"{source} lacks the field {e.args[0]!r} this architecture needs"
            ) from e

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens each, for every layer.

    On a GPU without `--num-kv-blocks`, `num_blocks` is None until the engine has loaded the
    model and profiled a forward: the pool then takes `gpu_memory_utilization` of the device
    memory, less the weights and the activations' peak.
    """

    block_size: int
    num_blocks: int | None
    enable_prefix_caching: bool
    dtype: torch.dtype  # of the stored keys and values: the model's, or an fp8 format
    gpu_memory_utilization: float = 0.9

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * model.num_layers * block_size * model.kv_size * dtype.itemsize


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    `max_num_seqs` bounds the requests holding KV blocks at once; `max_batch_size` bounds how
    many of them one forward carries; `max_prefill_tokens` bounds the prompt tokens one step
    computes (longer prompts are chunked); `max_num_batched_tokens` is the whole step's budget.
    """

    max_num_seqs: int
    max_batch_size: int
    max_prefill_tokens: int
    max_num_batched_tokens: int
    max_seq_len: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batch_size", "max_prefill_tokens", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is out of range: must be >= 1")
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_batch_size={self.max_batch_size} so every running request can decode"
            )
