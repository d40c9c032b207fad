"""Shared fixtures: tiny checkpoints of real architectures, built by the tests themselves.

Weights are random but drawn at a scale (see `WEIGHT_SCALE`) that leaves clear gaps between the
top logits, so greedy decoding is not decided by the last bits of a summation order.
"""

from __future__ import annotations

import os
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch

# CPU engines run their decode steps eagerly here: compiling costs each engine 10-30 s, so only
# the tests of the compiled path (tests/runner/test_compiled_decode.py) turn it on.
os.environ.setdefault("METRALE_COMPILE_CPU_DECODE", "0")
os.environ.setdefault("METRALE_FREEZE_HEAP", "0")  # each engine's full collection: see envs

WEIGHT_SCALE = 0.15

# Metrale's C++ CPU kernels (`kernels/cpu_extension.py`) build with g++ and ninja; where either is
# missing the engine runs the torch paths, and the tests of the kernels themselves skip.
needs_cpu_kernels = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("ninja") is None,
    reason="no g++ or ninja to build Metrale's CPU kernels with",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def demo_tokenizer_dir() -> Path:
    return Path(str(resources.files("metrale.demo") / "tokenizer"))


def build_checkpoint(
    out: Path, arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object
) -> Path:
    """Save a randomly initialised Hugging Face model of `arch` with the demo tokenizer."""
    import transformers
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(demo_tokenizer_dir() / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, WEIGHT_SCALE)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(demo_tokenizer_dir() / name, out / name)
    return out


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep the demo checkpoint the tests generate out of the user's cache."""
    import os

    os.environ["METRALE_CACHE_DIR"] = str(tmp_path_factory.mktemp("metrale-cache"))
