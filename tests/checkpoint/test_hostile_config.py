"""Absurd or hostile checkpoints: config.json, generation_config.json and tokenizer files.

Each is refused at load with a message naming the file and the field, before any tensor of the
config's shapes exists; the shapes of real models, the largest included, still load.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from metrale.checkpoint.weights import CheckpointError, iter_dummy_tensors
from metrale.config import MAX_NUM_PARAMETERS, ModelConfig
from metrale.engine_args import EngineArgs
from metrale.models import model_class_for
from tests.conftest import demo_tokenizer_dir

DEMO_VOCAB_SIZE = 4096  # the demo tokenizer's, added tokens included

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": DEMO_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "eos_token_id": 2,
}


def config_with(**changes: object) -> dict:
    """TINY with fields replaced; a value of ... removes the field."""
    raw = copy.deepcopy(TINY)
    for name, value in changes.items():
        if value is ...:
            raw.pop(name, None)
        else:
            raw[name] = value
    return raw


def write_checkpoint(out: Path, raw: object, *, tokenizer: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw))
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(demo_tokenizer_dir() / name, out / name)
    return out


# --- real shapes pass ---------------------------------------------------------------------------

LLAMA_3_1_405B = config_with(
    vocab_size=128256,
    hidden_size=16384,
    intermediate_size=53248,
    num_hidden_layers=126,
    num_attention_heads=128,
    num_key_value_heads=8,
    head_dim=...,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    eos_token_id=[128001, 128008, 128009],
    torch_dtype="bfloat16",
)
QWEN3_0_6B = config_with(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,  # 16 x 128 != 1024: head_dim is explicit
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    sliding_window=None,
    use_sliding_window=False,
    eos_token_id=151645,
)
QWEN2_5_7B_1M = config_with(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    head_dim=...,
    max_position_embeddings=1010000,
    sliding_window=131072,
    use_sliding_window=False,
    rope_theta=10000000.0,
    eos_token_id=151645,
)
MISTRAL_7B_V0_1 = config_with(
    architectures=["MistralForCausalLM"],
    model_type="mistral",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=...,
    max_position_embeddings=32768,
    sliding_window=4096,
    rms_norm_eps=1e-5,
    eos_token_id=2,
)
GEMMA_SIZED = config_with(  # Gemma 3 27B's sizes under a Llama architecture
    vocab_size=262144,
    hidden_size=5376,
    intermediate_size=21504,
    num_hidden_layers=62,
    num_attention_heads=32,
    num_key_value_heads=16,
    head_dim=128,
    max_position_embeddings=131072,
    eos_token_id=[1, 106],
)
LLAMA_4_SCOUT_CONTEXT = config_with(
    hidden_size=5120,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=10485760,
    vocab_size=202048,
)


@pytest.mark.parametrize(
    "raw",
    [
        TINY,
        LLAMA_3_1_405B,
        QWEN3_0_6B,
        QWEN2_5_7B_1M,
        MISTRAL_7B_V0_1,
        GEMMA_SIZED,
        LLAMA_4_SCOUT_CONTEXT,
    ],
    ids=["tiny", "llama-405b", "qwen3-0.6b", "qwen2.5-1m", "mistral-7b", "gemma-sized", "10m-ctx"],
)
def test_the_shapes_of_real_models_pass(raw: dict):
    config = ModelConfig.from_hf(raw)
    assert config.vocab_size == raw["vocab_size"]
    assert config.num_heads % config.num_kv_heads == 0
    assert config.num_parameters < MAX_NUM_PARAMETERS


def test_the_405b_shapes_are_counted_right():
    config = ModelConfig.from_hf(LLAMA_3_1_405B)
    assert config.head_dim == 128
    assert 400e9 < config.num_parameters < 410e9
    assert config.sliding_window is None


# --- absurd values are refused, naming the field ------------------------------------------------

ABSURD = [
    # (changes, field named in the message, what the message says)
    ({"vocab_size": 10**12}, "vocab_size", "out of range: must be in"),
    ({"vocab_size": -1}, "vocab_size", "out of range"),
    ({"vocab_size": 0}, "vocab_size", "out of range"),
    ({"vocab_size": "32000"}, "vocab_size", "is not an integer"),
    ({"vocab_size": 4096.0}, "vocab_size", "is not an integer"),
    ({"vocab_size": True}, "vocab_size", "is not an integer"),
    ({"hidden_size": -64}, "hidden_size", "out of range"),
    ({"hidden_size": 2**20}, "hidden_size", "out of range"),
    ({"hidden_size": [64]}, "hidden_size", "is not an integer"),
    ({"intermediate_size": 10**9}, "intermediate_size", "out of range"),
    ({"intermediate_size": 0}, "intermediate_size", "out of range"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers", "out of range"),
    ({"num_hidden_layers": 0}, "num_hidden_layers", "out of range"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers", "is not an integer"),
    ({"num_attention_heads": 0}, "num_attention_heads", "out of range"),
    ({"num_attention_heads": -4}, "num_attention_heads", "out of range"),
    ({"num_attention_heads": 10**6}, "num_attention_heads", "out of range"),
    ({"num_attention_heads": False}, "num_attention_heads", "is not an integer"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "does not divide num_attention_heads=4"),
    ({"num_key_value_heads": 8}, "num_key_value_heads", "does not divide"),
    ({"num_key_value_heads": 0}, "num_key_value_heads", "out of range"),
    (
        {"head_dim": ..., "num_attention_heads": 5, "num_key_value_heads": ...},
        "hidden_size",
        "not divisible by num_attention",
    ),
    ({"head_dim": 0}, "head_dim", "out of range"),
    ({"head_dim": 15}, "head_dim", "is odd"),
    ({"head_dim": 10**6}, "head_dim", "out of range"),
    ({"max_position_embeddings": 10**15}, "max_position_embeddings", "out of range"),
    ({"max_position_embeddings": 0}, "max_position_embeddings", "out of range"),
    ({"max_position_embeddings": "4k"}, "max_position_embeddings", "is not an integer"),
    (
        {"max_position_embeddings": 2**24, "head_dim": 256},
        "max_position_embeddings",
        "rotary tables would not fit",
    ),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps", "must be finite, positive"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps", "must be finite"),
    ({"rms_norm_eps": 0}, "rms_norm_eps", "positive"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps", "positive"),
    ({"rms_norm_eps": 2.0}, "rms_norm_eps", "below 1.0"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps", "is not a number"),
    ({"rope_theta": math.nan}, "rope_theta", "must be finite"),
    ({"rope_theta": -10000}, "rope_theta", "positive"),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, "rope_scaling.factor", "positive"),
    ({"rope_scaling": {"type": "linear", "factor": math.inf}}, "rope_scaling.factor", "finite"),
    ({"rope_scaling": "linear"}, "rope_scaling", "is not an object"),
    (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}},
        "rope_scaling.high_freq_factor",
        "must exceed low_freq_factor",
    ),
    (
        {"rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": -1}},
        "original_max_position_embeddings",
        "out of range",
    ),
    ({"sliding_window": -1}, "sliding_window", "out of range"),
    ({"sliding_window": 10**12}, "sliding_window", "out of range"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "is not true or false"),
    ({"attention_bias": 1}, "attention_bias", "is not true or false"),
    ({"eos_token_id": -1}, "eos_token_id", "out of range"),
    ({"eos_token_id": 10**12}, "eos_token_id", r"must be in \[0, 4,095\]"),
    ({"eos_token_id": [2, "</s>"]}, "eos_token_id", "is not an integer"),
    ({"eos_token_id": True}, "eos_token_id", "is not an integer"),
    ({"architectures": "LlamaForCausalLM"}, "architectures", "is not a list of names"),
    ({"architectures": [7]}, "architectures", "is not a list of names"),
    ({"model_type": "../../../../tmp/evil"}, "model_type", "is not a plain name"),
    ({"model_type": 3}, "model_type", "is not a plain name"),
    ({"torch_dtype": 16}, "torch_dtype", "is not a dtype name"),
    (
        {
            "hidden_size": 2**16,
            "intermediate_size": 2**18,
            "num_hidden_layers": 1024,
            "head_dim": 128,
        },
        "parameters",
        "its sizes are corrupt",
    ),
]


@pytest.mark.parametrize(("changes", "field", "says"), ABSURD, ids=[str(c) for c, _, _ in ABSURD])
def test_absurd_values_are_refused_naming_the_field(tmp_path: Path, changes, field, says):
    path = write_checkpoint(tmp_path / "ckpt", config_with(**changes), tokenizer=False)
    with pytest.raises(ValueError, match=says) as excinfo:
        ModelConfig.from_dir(path)
    message = str(excinfo.value)
    assert field in message
    assert str(path / "config.json") in message


def test_a_config_that_is_not_an_object(tmp_path: Path):
    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object, got list"):
        ModelConfig.from_dir(tmp_path)


def test_a_huge_value_is_shortened_in_the_message():
    with pytest.raises(ValueError) as excinfo:
        ModelConfig.from_hf(config_with(vocab_size="9" * 100_000))
    assert len(str(excinfo.value)) < 400


# --- nothing is allocated ---------------------------------------------------------------------


@pytest.fixture
def no_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a tensor of any size is created through the usual constructors."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a tensor was allocated: {args!r}")

    for name in ("empty", "zeros", "ones", "randn", "rand", "full", "arange", "outer", "tensor"):
        monkeypatch.setattr(torch, name, refuse)


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
@pytest.mark.parametrize(
    "changes",
    [
        {"vocab_size": 10**12},
        {"num_hidden_layers": 10**9},
        {"max_position_embeddings": 10**15},
        {"hidden_size": 10**7, "head_dim": ...},
    ],
    ids=str,
)
def test_absurd_configs_fail_before_any_allocation(
    tmp_path: Path, no_allocation: None, load_format: str, changes: dict
):
    path = write_checkpoint(tmp_path / "ckpt", config_with(**changes))
    args = EngineArgs(model_from_path=str(path), load_format=load_format, device="cpu")
    with pytest.raises(ValueError, match=next(iter(changes))):
        args.create_config()


def test_dummy_weights_refuse_shapes_that_bypass_the_config_check(no_allocation: None):
    config = dataclasses.replace(ModelConfig.from_hf(TINY), vocab_size=10**12)
    shapes = model_class_for(config.architecture).checkpoint_shapes(config)
    with pytest.raises(CheckpointError, match=r"parameters, above .* no dummy weights drawn"):
        next(iter_dummy_tensors(shapes, torch.device("cpu")))


def test_dummy_weights_of_a_sane_config_are_drawn():
    config = ModelConfig.from_hf(TINY)
    shapes = model_class_for(config.architecture).checkpoint_shapes(config)
    tensors = dict(iter_dummy_tensors(shapes, torch.device("cpu")))
    assert tensors["model.embed_tokens.weight"].shape == (DEMO_VOCAB_SIZE, 64)


# --- tokenizer files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\xff\xfe not json at all",
        b'{"version": "1.0", "model": ',
        b"[]",
        b"{}",
        b'{"model": 1}',
    ],
    ids=["binary", "truncated", "list", "empty-object", "wrong-model"],
)
def test_a_garbage_tokenizer_json_is_named_at_load(tmp_path: Path, garbage: bytes):
    path = write_checkpoint(tmp_path / "ckpt", TINY)
    (path / "tokenizer.json").write_bytes(garbage)
    with pytest.raises(ValueError, match="re-download the checkpoint") as excinfo:
        EngineArgs(model_from_path=str(path), device="cpu").create_config()
    assert str(path / "tokenizer.json") in str(excinfo.value)


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (b"\xff\xfe\x00", "is not valid JSON"),
        (b'"a string"', "must hold a JSON object"),
        (b'{"added_tokens_decoder": [1, 2]}', "added_tokens_decoder must map token ids"),
        (b'{"added_tokens_decoder": {"x": {"content": "<a>"}}}', "added_tokens_decoder"),
        (b'{"added_tokens_decoder": {"5": "<a>"}}', "added_tokens_decoder"),
        (b'{"additional_special_tokens": 7}', "additional_special_tokens must be a list"),
        (b'{"eos_token": 7}', "eos_token must be a string"),
    ],
)
def test_a_garbage_tokenizer_config_is_named_at_load(tmp_path: Path, config: bytes, says: str):
    path = write_checkpoint(tmp_path / "ckpt", TINY)
    (path / "tokenizer_config.json").write_bytes(config)
    with pytest.raises(ValueError, match=says) as excinfo:
        EngineArgs(model_from_path=str(path), device="cpu").create_config()
    assert str(path / "tokenizer_config.json") in str(excinfo.value)


def test_a_tokenizer_of_another_model_is_refused(tmp_path: Path):
    path = write_checkpoint(tmp_path / "ckpt", config_with(vocab_size=1000, eos_token_id=...))
    with pytest.raises(ValueError, match=r"ids up to 4,095 .* vocab_size=1,000") as excinfo:
        EngineArgs(model_from_path=str(path), device="cpu").create_config()
    assert "come from different models" in str(excinfo.value)


def test_added_tokens_past_the_vocabulary_only_warn(tmp_path: Path, caplog):
    path = write_checkpoint(tmp_path / "ckpt", TINY)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["added_tokens_decoder"]["4096"] = {"content": "<pad_extra>", "special": True}
    tokenizer_config["eos_token"] = "<pad_extra>"
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = EngineArgs(model_from_path=str(path), device="cpu").create_config()
    assert config.model.vocab_size == DEMO_VOCAB_SIZE
    assert all(t < DEMO_VOCAB_SIZE for t in config.eos_token_ids)  # the EOS past it is dropped
    assert "past the model's vocab_size=4096 (<pad_extra>)" in caplog.text
    assert "EOS token id 4096 is outside the model's vocabulary" in caplog.text


@pytest.mark.parametrize(
    ("generation_config", "says"),
    [
        ({"eos_token_id": 10**9}, r"eos_token_id 1000000000 is outside the model's vocabulary"),
        ({"eos_token_id": [2, -1]}, "is not a token id"),
        ({"eos_token_id": "2"}, "is not a token id"),
        ({"temperature": "hot"}, "sampling defaults no request could use"),
        ({"top_p": 7.0}, "sampling defaults no request could use"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_absurd_generation_defaults_are_refused(tmp_path: Path, generation_config, says: str):
    path = write_checkpoint(tmp_path / "ckpt", TINY)
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    with pytest.raises(ValueError, match=says) as excinfo:
        EngineArgs(model_from_path=str(path), device="cpu").create_config()
    assert "generation_config.json" in str(excinfo.value)


def test_a_sane_checkpoint_directory_still_loads(tmp_path: Path):
    path = write_checkpoint(tmp_path / "ckpt", TINY)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "top_p": 0.9}))
    config = EngineArgs(model_from_path=str(path), device="cpu").create_config()
    assert config.model.num_kv_heads == 2 and 2 in config.eos_token_ids


# --- met serve --------------------------------------------------------------------------------


MET_SERVE = (sys.executable, "-m", "metrale", "serve")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("break_checkpoint", "says"),
    [
        (lambda path: None, "vocab_size=1000000000000 is out of range"),
        (
            lambda path: (path / "tokenizer.json").write_bytes(b"\x00garbage"),
            "tokenizer.json is not a tokenizer the tokenizers library can load",
        ),
    ],
    ids=["absurd-vocab", "garbage-tokenizer"],
)
def test_met_serve_exits_with_the_message_at_load_config(tmp_path: Path, break_checkpoint, says):
    vocab_size = 10**12 if "vocab" in says else DEMO_VOCAB_SIZE
    path = write_checkpoint(tmp_path / "ckpt", config_with(vocab_size=vocab_size))
    break_checkpoint(path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    start = time.monotonic()
    result = subprocess.run(
        [
            *MET_SERVE,
            "--model-from-path",
            str(path),
            "--port",
            str(_free_port()),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode != 0
    assert says in result.stderr
    assert result.stderr.count("met serve: error:") == 1
    assert "Traceback" not in result.stderr
    assert "resolve model" in result.stderr and "load config " not in result.stderr
    assert time.monotonic() - start < 60
