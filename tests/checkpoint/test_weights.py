"""Checkpoint preflight, loading (single file, sharded, dummy) and config.json parsing.

Every broken checkpoint is a copy of the tiny Llama checkpoint from `tests.conftest`, edited in
one way, so each failure has exactly one cause to name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale.checkpoint.weights import CheckpointError, preflight
from metrale.config import ModelConfig, RopeConfig
from metrale.models import model_class_for, supported_architectures
from metrale.runner.model_loader import load_model

CPU = torch.device("cpu")


def expected_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    config = ModelConfig.from_dir(model_dir)
    return model_class_for(config.architecture).checkpoint_shapes(config)


def load_state_dict(model_dir: Path, **kwargs: object) -> dict[str, torch.Tensor]:
    kwargs = {"dtype": torch.float32, "device": CPU, "progress": False, **kwargs}
    model = load_model(model_dir, ModelConfig.from_dir(model_dir), **kwargs)  # type: ignore[arg-type]
    return model.state_dict()


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(path: Path, edit) -> None:  # edit: dict -> None, in place
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(model_dir: Path, edit) -> None:  # edit: dict -> None, in place
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def reshard(model_dir: Path, num_shards: int) -> list[str]:
    """Split model.safetensors round-robin into shards with an index, as save_pretrained does.

    Round-robin puts q/k/v and gate/up of one layer in different files, so loading must fuse
    across shards.
    """
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {name: names[i % num_shards] for i, name in enumerate(sorted(tensors))}
    for shard in names:
        part = {n: t for n, t in tensors.items() if weight_map[n] == shard}
        save_file(part, model_dir / shard, metadata={"format": "pt"})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return names


@pytest.fixture
def ckpt(llama_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama checkpoint, free to break."""
    return copy_checkpoint(llama_dir, tmp_path / "ckpt")


# --- preflight and loading ------------------------------------------------------------------------


def test_preflight_passes_on_a_good_checkpoint(llama_dir: Path):
    expected = expected_shapes(llama_dir)
    found = preflight(llama_dir, expected)
    assert set(found) == set(expected)
    for name, info in found.items():
        assert info.file == llama_dir / "model.safetensors"
        assert info.shape == expected[name]
        assert info.dtype == "F32"


def test_loaded_weights_are_the_checkpoint_tensors_fused(llama_dir: Path):
    raw = load_file(llama_dir / "model.safetensors")
    state = load_state_dict(llama_dir)
    assert torch.equal(state["model.embed_tokens.weight"], raw["model.embed_tokens.weight"])
    assert torch.equal(state["lm_head.weight"], raw["lm_head.weight"])
    for n in range(2):
        p = f"model.layers.{n}."
        qkv = [raw[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        assert torch.equal(state[p + "self_attn.qkv_proj.weight"], torch.cat(qkv))
        gate_up = [raw[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]
        assert torch.equal(state[p + "mlp.gate_up_proj.weight"], torch.cat(gate_up))
        assert torch.equal(state[p + "mlp.down_proj.weight"], raw[p + "mlp.down_proj.weight"])


def test_sharded_checkpoint_loads_the_same_weights(llama_dir: Path, ckpt: Path):
    shard_names = reshard(ckpt, 3)
    found = preflight(ckpt, expected_shapes(ckpt))
    assert {info.file.name for info in found.values()} == set(shard_names)
    single, sharded = load_state_dict(llama_dir), load_state_dict(ckpt)
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name


def test_safetensors_without_index_or_standard_name_are_found(llama_dir: Path, ckpt: Path):
    (ckpt / "model.safetensors").rename(ckpt / "weights.safetensors")
    found = preflight(ckpt, expected_shapes(ckpt))
    assert {info.file.name for info in found.values()} == {"weights.safetensors"}


def test_extra_tensors_in_the_checkpoint_are_ignored(llama_dir: Path, ckpt: Path):
    # Older Llama checkpoints carry rotary inverse frequencies the model recomputes.
    def add_inv_freq(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    rewrite_tensors(ckpt / "model.safetensors", add_inv_freq)
    expected = expected_shapes(ckpt)
    assert set(preflight(ckpt, expected)) == set(expected)


def test_a_tensor_the_model_would_not_load_is_named(ckpt: Path, caplog):
    """A weight the model has no place for (a bias its config does not announce) would be
    silently dropped: the load says which."""

    def add_bias(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.1.self_attn.o_proj.bias"] = torch.ones(64)

    rewrite_tensors(ckpt / "model.safetensors", add_bias)
    with caplog.at_level("WARNING", logger="metrale.checkpoint.weights"):
        preflight(ckpt, expected_shapes(ckpt))
    assert "model.layers.1.self_attn.o_proj.bias" in caplog.text
    assert "does not load" in caplog.text


# --- preflight errors -----------------------------------------------------------------------------


def test_missing_tensor_is_named(ckpt: Path):
    rewrite_tensors(
        ckpt / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.down_proj.weight")
    )
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.down_proj"):
        preflight(ckpt, expected_shapes(ckpt))


def test_many_problems_are_summarised(ckpt: Path):
    save_file({"unrelated": torch.zeros(1)}, ckpt / "model.safetensors")
    expected = expected_shapes(ckpt)
    with pytest.raises(CheckpointError) as excinfo:
        preflight(ckpt, expected)
    message = str(excinfo.value)
    assert message.count("missing tensor") == 10
    assert f"... and {len(expected) - 10} more" in message


def test_wrong_shape_names_tensor_file_and_both_shapes(ckpt: Path):
    edit_config(ckpt, lambda raw: raw.update(intermediate_size=128))
    with pytest.raises(CheckpointError) as excinfo:
        load_model(
            ckpt, ModelConfig.from_dir(ckpt), dtype=torch.float32, device=CPU, progress=False
        )
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert (
        "model.layers.0.mlp.gate_proj.weight in model.safetensors has shape [160, 64], "
        "config.json implies [128, 64]"
    ) in message
    assert "model.layers.1.mlp.down_proj.weight in model.safetensors has shape [64, 160]" in message
    assert "does not match its config.json" in message
    assert "self_attn" not in message, "only the MLP tensors depend on intermediate_size"


def test_integer_dtype_is_rejected(ckpt: Path):
    def quantize(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int8)

    rewrite_tensors(ckpt / "model.safetensors", quantize)
    with pytest.raises(
        CheckpointError, match=r"model\.norm\.weight in model\.safetensors has dtype I8"
    ):
        preflight(ckpt, expected_shapes(ckpt))


@pytest.mark.parametrize("keep_fraction", [0.5, 0.0001])
def test_truncated_file_is_named(ckpt: Path, keep_fraction: float):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: max(4, int(len(data) * keep_fraction))])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable .*truncated"):
        preflight(ckpt, expected_shapes(ckpt))


def test_truncated_shard_is_named(ckpt: Path):
    shard_names = reshard(ckpt, 3)
    broken = ckpt / shard_names[1]
    broken.write_bytes(broken.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as excinfo:
        preflight(ckpt, expected_shapes(ckpt))
    assert str(broken) in str(excinfo.value)
    assert shard_names[0] not in str(excinfo.value)


def test_index_listing_a_missing_shard(ckpt: Path):
    shard_names = reshard(ckpt, 3)
    (ckpt / shard_names[2]).unlink()
    with pytest.raises(CheckpointError, match=rf"lists shards that are missing.*{shard_names[2]}"):
        preflight(ckpt, expected_shapes(ckpt))


def test_index_that_is_not_json(ckpt: Path):
    reshard(ckpt, 2)
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"not a valid safetensors index"):
        preflight(ckpt, expected_shapes(ckpt))


def test_directory_without_safetensors(ckpt: Path):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no safetensors weights in .*ckpt"):
        preflight(ckpt, expected_shapes(ckpt))


# --- dummy weights --------------------------------------------------------------------------------


@pytest.fixture
def config_only_dir(llama_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "config-only"
    out.mkdir()
    shutil.copyfile(llama_dir / "config.json", out / "config.json")
    return out


def test_dummy_load_needs_only_config_json(llama_dir: Path, config_only_dir: Path):
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_state_dict(config_only_dir)
    dummy = load_state_dict(config_only_dir, load_format="dummy")
    real = load_state_dict(llama_dir)
    assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in real.items()}
    for name, tensor in dummy.items():
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:
            assert 0.01 < tensor.std().item() < 0.03, name  # drawn at scale 0.02
    assert torch.equal(
        dummy["model.embed_tokens.weight"],
        load_state_dict(config_only_dir, load_format="dummy")["model.embed_tokens.weight"],
    ), "the same seed draws the same weights"
    other_seed = load_state_dict(config_only_dir, load_format="dummy", seed=1)
    assert not torch.equal(dummy["lm_head.weight"], other_seed["lm_head.weight"])


def test_dummy_load_uses_the_requested_dtype(config_only_dir: Path):
    state = load_state_dict(config_only_dir, load_format="dummy", dtype=torch.bfloat16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32, "the default dtype is restored"


def test_unknown_load_format(config_only_dir: Path):
    with pytest.raises(ValueError, match=r"load_format='pt'.*auto, safetensors, gguf, dummy"):
        load_state_dict(config_only_dir, load_format="pt")


# --- config.json ----------------------------------------------------------------------------------


def test_config_of_the_tiny_llama(llama_dir: Path):
    # The values build_checkpoint passes to transformers.LlamaConfig.
    config = ModelConfig.from_dir(llama_dir)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (64, 160, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.q_size, config.kv_size) == (64, 32)
    assert config.rope == RopeConfig(theta=10000.0, rope_type="default")
    assert config.dtype == torch.float32
    assert config.eos_token_ids == ()
    assert config.tie_word_embeddings is False


def test_missing_config_json(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        ModelConfig.from_dir(tmp_path)


def test_config_json_that_is_not_json(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON.*re-download"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_config_missing_a_required_field(ckpt: Path, field: str):
    edit_config(ckpt, lambda raw: raw.pop(field))
    with pytest.raises(ValueError, match=rf"config\.json lacks the field '{field}'"):
        ModelConfig.from_dir(ckpt)


def test_config_without_architectures(ckpt: Path):
    edit_config(ckpt, lambda raw: raw.pop("architectures"))
    with pytest.raises(ValueError, match=r"names no `architectures`"):
        ModelConfig.from_dir(ckpt)


def test_unknown_architecture_lists_the_supported_ones():
    supported = supported_architectures()
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(supported)
    with pytest.raises(ValueError) as excinfo:
        model_class_for("GPT2LMHeadModel")
    message = str(excinfo.value)
    assert "'GPT2LMHeadModel'" in message and "not supported" in message
    assert all(name in message for name in supported)


# --- rope -----------------------------------------------------------------------------------------


def old_style_rope(rope_scaling: dict | None, theta: float = 500000.0):
    def edit(raw: dict) -> None:
        raw.pop("rope_parameters", None)
        raw["rope_theta"] = theta
        raw["rope_scaling"] = rope_scaling

    return edit


def test_old_style_linear_rope_scaling(ckpt: Path):
    edit_config(ckpt, old_style_rope({"type": "linear", "factor": 2}))
    rope = ModelConfig.from_dir(ckpt).rope
    assert rope == RopeConfig(theta=500000.0, rope_type="linear", factor=2.0)


def test_old_style_rope_theta_without_scaling(ckpt: Path):
    edit_config(ckpt, old_style_rope(None, theta=1e6))
    assert ModelConfig.from_dir(ckpt).rope == RopeConfig(theta=1e6)


def test_old_style_llama3_rope_scaling(ckpt: Path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    edit_config(ckpt, old_style_rope(scaling))
    assert ModelConfig.from_dir(ckpt).rope == RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


def test_rope_parameters_of_transformers_5(ckpt: Path):
    params = {"rope_theta": 250000.0, "rope_type": "linear", "factor": 4.0}
    edit_config(ckpt, lambda raw: raw.update(rope_parameters=params))
    assert ModelConfig.from_dir(ckpt).rope == RopeConfig(
        theta=250000.0, rope_type="linear", factor=4.0
    )


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_unsupported_rope_type(ckpt: Path, key: str):
    edit_config(ckpt, old_style_rope({key: "yarn", "factor": 4.0}))
    with pytest.raises(
        ValueError, match=r"rope_type='yarn'.*not supported.*default, linear, llama3"
    ):
        ModelConfig.from_dir(ckpt)
