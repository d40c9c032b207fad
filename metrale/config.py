"""Configuration: one frozen dataclass per concern, resolved once at startup.

`ModelConfig` is what the engine needs from a checkpoint's `config.json`, parsed into plain fields
so no code downstream reads the raw dict. `CacheConfig` and `SchedulerConfig` come from engine
flags (`EngineArgs`). Every derived value is computed here, once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale.distributed.sharding import check_split

if TYPE_CHECKING:
    import torch

# Names of torch's dtypes, looked up when a config is resolved: `met serve` reads its flags and
# starts the engine process before it imports torch (entrypoints/cli/serve.py).
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def parse_dtype(name: str) -> torch.dtype:
    import torch

    try:
        return getattr(torch, _DTYPES[name.removeprefix("torch.")])
    except KeyError:
        allowed = ", ".join(sorted({"float32", "float16", "bfloat16"}))
        raise ValueError(f"dtype={name!r} is not supported: use one of {allowed} or auto") from None


# fp8 caches store each key and value as it is (scale 1, as vLLM without calibrated scales),
# saturated to the format's largest finite value: half the bytes of bf16 to read every step.
_KV_CACHE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
KV_CACHE_DTYPE_NAMES = ("auto", *_KV_CACHE_DTYPES)


def is_fp8(dtype: torch.dtype) -> bool:
    import torch

    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: `auto` stores keys and values in the model's dtype."""
    import torch

    if name == "auto":
        return model_dtype
    try:
        return getattr(torch, _KV_CACHE_DTYPES[name])
    except KeyError:
        allowed = ", ".join(KV_CACHE_DTYPE_NAMES)
        raise ValueError(
            f"kv_cache_dtype={name!r} is not supported: use one of {allowed}"
        ) from None


# Bounds on the sizes config.json declares, checked before any tensor of those shapes exists
# (the preflight, `--load-format dummy` and the demo all build shapes from them). No real
# checkpoint comes near one: the largest dense Llama-family model, Llama 3.1 405B, has hidden
# 16,384, intermediate 53,248, 126 layers and 128 heads; vocabularies reach 262,144 (Gemma 3);
# contexts reach about 10M positions (Llama 4 Scout). Yet every absurd value (a 10^12 vocabulary,
# 10^9 layers, 10^15 positions) exceeds one, so a hostile or corrupt config.json fails here, with
# the field named, rather than in an allocation.
MAX_VOCAB_SIZE = 2**22  # 16x the largest real vocabulary
MAX_HIDDEN_SIZE = 2**16
MAX_INTERMEDIATE_SIZE = 2**18
MAX_NUM_LAYERS = 1024
MAX_NUM_HEADS = 1024  # for num_attention_heads and num_key_value_heads
MAX_HEAD_DIM = 1024  # real models use 64 to 256
MAX_POSITIONS = 2**24  # for max_position_embeddings and sliding_window
# The cos and sin tables hold max_position_embeddings x head_dim fp32 values each: 2^31 of them
# is 8 GiB a table, above Llama 4 Scout's 10M x 128.
MAX_ROTARY_TABLE_ELEMENTS = 2**31
MAX_NUM_PARAMETERS = 2**41  # about 2.2 trillion, five times Llama 3.1 405B
# A model_type names a file (metrale/jinja-templates/<model_type>.jinja), so no path separators.
_MODEL_TYPE = re.compile(r"[A-Za-z0-9_\-]*")
_MISSING = object()


class _ConfigFields:
    """Reads config.json's values, each checked for its JSON type and range as it is read.

    json.loads gives bool for true/false and int only for integer literals, so a string, a float
    or a bool where a size belongs is refused rather than coerced; every error names the field.
    """

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def fail(self, name: str, value: object, problem: str) -> ValueError:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return ValueError(
            f"{self.source}: {name}={shown} {problem}; the checkpoint's config.json is corrupt "
            f"or not of a model metrale can load"
        )

    def get(self, name: str, default: object = _MISSING) -> Any:
        """The field's value; null counts as absent, as transformers' configs read it."""
        value = self.raw.get(name)
        if value is not None:
            return value
        if default is _MISSING:
            raise ValueError(f"{self.source} lacks the field {name!r} this architecture needs")
        return default

    def check_int(self, name: str, value: object, *, low: int, high: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(name, value, "is not an integer")
        if not low <= value <= high:
            raise self.fail(name, value, f"is out of range: must be in [{low:,}, {high:,}]")
        return value

    def read_int(self, name: str, *, high: int, low: int = 1, default: object = _MISSING) -> int:
        return self.check_int(name, self.get(name, default), low=low, high=high)

    def read_optional_int(self, name: str, *, high: int, low: int = 1) -> int | None:
        value = self.raw.get(name)
        return None if value is None else self.check_int(name, value, low=low, high=high)

    def check_float(self, name: str, value: object, *, below: float = math.inf) -> float:
        """A finite number in (0, below): epsilons, rope thetas and scaling factors."""
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.fail(name, value, "is not a number")
        if not (math.isfinite(value) and 0 < value < below):
            bound = "" if below == math.inf else f" and below {below}"
            raise self.fail(name, value, f"is out of range: must be finite, positive{bound}")
        return float(value)

    def read_bool(self, name: str, default: bool) -> bool:
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(name, value, "is not true or false")
        return value


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
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> RopeConfig:
        # transformers >= 5 writes `rope_parameters`; older checkpoints write `rope_theta` plus an
        # optional `rope_scaling` dict whose type key is `rope_type` or, older still, `type`.
        key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
        params = raw.get(key) or {}
        fields = _ConfigFields(raw, source)
        if not isinstance(params, dict):
            raise fields.fail(key, params, "is not an object")
        scaling = _ConfigFields(params, source)
        theta = scaling.get("rope_theta", fields.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in cls.SUPPORTED:
            raise ValueError(
                f"rope_type={rope_type!r} in config.json is not supported yet "
                f"(supported: {', '.join(cls.SUPPORTED)})"
            )
        rope = cls(
            theta=fields.check_float(
                f"{key}.rope_theta" if "rope_theta" in params else "rope_theta", theta
            ),
            rope_type=rope_type,
            factor=fields.check_float(f"{key}.factor", scaling.get("factor", 1.0)),
            low_freq_factor=fields.check_float(
                f"{key}.low_freq_factor", scaling.get("low_freq_factor", 1.0)
            ),
            high_freq_factor=fields.check_float(
                f"{key}.high_freq_factor", scaling.get("high_freq_factor", 4.0)
            ),
            original_max_position_embeddings=scaling.read_optional_int(
                "original_max_position_embeddings", high=MAX_POSITIONS
            ),
        )
        # Llama 3's scaling blends between the two factors, dividing by their difference.
        if rope.rope_type == "llama3" and not rope.high_freq_factor > rope.low_freq_factor:
            raise fields.fail(
                f"{key}.high_freq_factor",
                rope.high_freq_factor,
                f"must exceed low_freq_factor ({rope.low_freq_factor}) for llama3 scaling",
            )
        return rope


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
    # Ranks the model is split over (`with_tensor_parallel`): the per-rank sizes below hold
    # one rank's heads, which is what its attention and its KV pool are built for.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size={tp} is out of range: must be >= 1")
        if tp > 1:  # the vocabulary is padded instead (distributed/sharding.py)
            check_split("num_attention_heads", self.num_heads, tp)
            check_split("num_key_value_heads", self.num_kv_heads, tp, replicable=True)
            check_split("intermediate_size", self.intermediate_size, tp)

    def with_tensor_parallel(self, tensor_parallel_size: int) -> ModelConfig:
        """This config split over `tensor_parallel_size` ranks; a ValueError names any size
        that does not split."""
        return dataclasses.replace(self, tensor_parallel_size=tensor_parallel_size)

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
        """Parse and check config.json; a ValueError names the field that is missing or absurd."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source} must hold a JSON object, got {type(raw).__name__}")
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ValueError(f"{source} names no `architectures`: cannot tell which model to build")
        fields = _ConfigFields(raw, source)
        if not isinstance(architectures, list) or not all(
            isinstance(name, str) for name in architectures
        ):
            raise fields.fail("architectures", architectures, "is not a list of names")
        model_type = raw.get("model_type") or ""
        if not isinstance(model_type, str) or not _MODEL_TYPE.fullmatch(model_type):
            raise fields.fail("model_type", model_type, "is not a plain name")
        vocab_size = fields.read_int("vocab_size", high=MAX_VOCAB_SIZE)
        hidden_size = fields.read_int("hidden_size", high=MAX_HIDDEN_SIZE)
        num_heads = fields.read_int("num_attention_heads", high=MAX_NUM_HEADS)
        num_kv_heads = fields.read_optional_int("num_key_value_heads", high=MAX_NUM_HEADS)
        if num_kv_heads is None:
            num_kv_heads = num_heads
        elif num_heads % num_kv_heads:
            raise fields.fail(
                "num_key_value_heads",
                num_kv_heads,
                f"does not divide num_attention_heads={num_heads}: each kv head serves a whole "
                f"group of query heads",
            )
        head_dim = fields.read_optional_int("head_dim", high=MAX_HEAD_DIM)
        if head_dim is None:  # implied by the hidden size, which must then split evenly
            if hidden_size % num_heads:
                raise fields.fail(
                    "hidden_size",
                    hidden_size,
                    f"is not divisible by num_attention_heads={num_heads} (and no head_dim is "
                    f"given)",
                )
            head_dim = fields.check_int(
                "head_dim", hidden_size // num_heads, low=1, high=MAX_HEAD_DIM
            )
        if head_dim % 2:
            raise fields.fail("head_dim", head_dim, "is odd: rotary embeddings rotate pairs")
        max_positions = fields.read_int("max_position_embeddings", high=MAX_POSITIONS, default=4096)
        if max_positions * head_dim > MAX_ROTARY_TABLE_ELEMENTS:
            raise fields.fail(
                "max_position_embeddings",
                max_positions,
                f"times head_dim={head_dim} exceeds {MAX_ROTARY_TABLE_ELEMENTS:,}: the rotary "
                f"tables would not fit in memory",
            )
        # Qwen2 checkpoints carry a `sliding_window` they do not use unless told to.
        sliding_window = None
        if raw.get("use_sliding_window") is not False and raw.get("sliding_window"):
            sliding_window = fields.read_int("sliding_window", high=MAX_POSITIONS)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        for eos_id in eos_ids:
            fields.check_int("eos_token_id", eos_id, low=0, high=vocab_size - 1)
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if not isinstance(dtype, str):
            raise fields.fail("torch_dtype", dtype, "is not a dtype name")
        config = cls(
            architecture=architectures[0],
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=fields.read_int("intermediate_size", high=MAX_INTERMEDIATE_SIZE),
            num_layers=fields.read_int("num_hidden_layers", high=MAX_NUM_LAYERS),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.check_float(
                "rms_norm_eps", fields.get("rms_norm_eps", 1e-6), below=1.0
            ),
            rope=RopeConfig.from_hf(raw, source),
            max_position_embeddings=max_positions,
            tie_word_embeddings=fields.read_bool("tie_word_embeddings", False),
            attention_bias=fields.read_bool("attention_bias", False),
            sliding_window=sliding_window,
            dtype=parse_dtype(dtype),
            eos_token_ids=eos_ids,
        )
        if config.num_parameters > MAX_NUM_PARAMETERS:
            raise ValueError(
                f"{source} describes a model of {config.num_parameters:,} parameters (above "
                f"{MAX_NUM_PARAMETERS:,}): its sizes are corrupt"
            )
        return config

    @property
    def num_parameters(self) -> int:
        """Weights of the matrices (norms and biases, a rounding error, left out)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        attention = self.hidden_size * (2 * self.q_size + 2 * self.kv_size)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return embeddings + self.num_layers * (attention + mlp)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_heads_per_rank(self) -> int:
        return self.num_heads // self.tensor_parallel_size

    @property
    def num_kv_heads_per_rank(self) -> int:
        """Fewer KV heads than ranks: each rank keeps the one its query heads read."""
        return max(1, self.num_kv_heads // self.tensor_parallel_size)

    @property
    def q_size_per_rank(self) -> int:
        return self.num_heads_per_rank * self.head_dim

    @property
    def kv_size_per_rank(self) -> int:
        return self.num_kv_heads_per_rank * self.head_dim


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
    num_host_blocks: int = 0  # the swap space (`--swap-space-gb`): host blocks for preemption

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """On one rank: its KV heads (all of them without tensor parallelism)."""
        return 2 * model.num_layers * block_size * model.kv_size_per_rank * dtype.itemsize


PREEMPTION_MODES = ("auto", "swap", "recompute")


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
    policy: str = "fifo"  # scheduling_policy.POLICIES
    tbt_deadline_ms: float | None = None  # slai's time-between-tokens deadline
    # How a preempted request gives up its blocks, with a swap space: auto (swap when the copies
    # are cheaper than recomputing), swap (whenever the host pool has room), recompute.
    preemption_mode: str = "auto"

    def __post_init__(self) -> None:
        from metrale.engine.scheduling_policy import make_policy

        make_policy(self.policy, self.tbt_deadline_ms)  # a bad policy or deadline fails here
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r} is not one of {PREEMPTION_MODES}"
            )
        for name in ("max_num_seqs", "max_batch_size", "max_prefill_tokens", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is out of range: must be >= 1")
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_batch_size={self.max_batch_size} so every running request can decode"
            )
