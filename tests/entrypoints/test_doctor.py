"""`met doctor`: good setups pass, each broken one fails its own check with the fix named."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from metrale.entrypoints.cli import doctor_checks, main
from tests.conftest import TOKENIZER_FILES, demo_tokenizer_dir

BLOCK_SIZE = 16


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    """Run `met doctor ARGV --json` in this process: (exit code, the JSON report)."""
    if "--port" not in argv:
        argv = (*argv, "--port", str(_free_port()))
    code = main(["doctor", *argv, "--json"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, json.loads(out)


def _check(report: dict, name: str) -> dict:
    (check,) = [c for c in report["checks"] if c["name"] == name]
    return check


def _write_checkpoint(out: Path, **overrides: object) -> Path:
    """A tiny Qwen3 checkpoint of random weights, written from the model's own shapes."""
    from tokenizers import Tokenizer

    from metrale.checkpoint.weights import iter_dummy_tensors
    from metrale.config import ModelConfig
    from metrale.models import model_class_for

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(demo_tokenizer_dir() / "tokenizer.json"))
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        **overrides,
    }
    (out / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig.from_hf(config)
    shapes = model_class_for(model_config.architecture).checkpoint_shapes(model_config)
    tensors = dict(iter_dummy_tensors(shapes, torch.device("cpu")))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    for name in TOKENIZER_FILES:
        shutil.copyfile(demo_tokenizer_dir() / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_demo_model_passes_and_chooses_what_serve_would(capsys):
    from metrale import demo
    from metrale.frontend.parser_selection import FLAGS, behavior_sources, choose_behavior
    from metrale.recipes import Behavior, Checkpoint
    from metrale.tokenizer import Tokenizer

    code, report = _doctor(capsys)
    assert code == 0, [c for c in report["checks"] if c["status"] == "fail"]
    assert report["ok"] and report["exit_code"] == 0
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    for name in ("model", "config", "architecture", "engine config", "weights", "memory"):
        assert statuses[name] == "ok", name
    platform = report["facts"]["platform"]
    assert platform["torch"] == torch.__version__
    assert platform["gpus"] == [] or torch.cuda.is_available()
    assert platform["cpu"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    model = report["facts"]["model"]
    assert model["name"] == demo.MODEL_NAME
    assert model["weight_bytes"] > 0 and model["memory"]["fits"]
    assert report["facts"]["hf_cache"]["path"]

    # The choice `met serve` makes, as `_start_and_serve` makes it.
    model_dir = Path(model["model_dir"])
    checkpoint = Checkpoint(demo.repo_id(), model["architecture"], model["model_type"])
    sources = behavior_sources(Behavior(), model_dir, checkpoint)
    tokenizer = Tokenizer.from_dir(model_dir, model_type=model["model_type"])
    template = "\n".join(t.text for t in tokenizer.chat_template.sources.values())
    choice = choose_behavior(sources, template)
    assert model["behavior"]["tool_call_parser"] == choice.tool_call_parser
    assert model["behavior"]["reasoning_parser"] == choice.reasoning_parser
    assert model["behavior"]["tool_call_parser_source"] == choice.tool_call_parser_source
    assert _check(report, "parsers")["detail"] == choice.describe()
    recipes = [s.label for s in sources if s.label != FLAGS and "tool_defaults" not in s.label]
    assert model["recipes"] == recipes


def test_flags_reach_the_parser_choice(tiny_dir, capsys):
    code, report = _doctor(
        capsys, str(tiny_dir), "--tool-call-parser", "hermes", "--reasoning-parser", "none"
    )
    assert code == 0
    behavior = report["facts"]["model"]["behavior"]
    assert behavior["tool_call_parser"] == "hermes"
    assert behavior["tool_call_parser_source"] == "--tool-call-parser"
    assert behavior["reasoning_parser"] is None


def test_unsupported_architecture_fails_with_the_supported_ones_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"})
    )
    code, report = _doctor(capsys, str(tmp_path))
    assert code == 1 and not report["ok"]
    check = _check(report, "architecture")
    assert check["status"] == "fail"
    assert "MambaForCausalLM" in check["detail"]
    assert "LlamaForCausalLM" in check["fix"] and "Qwen3ForCausalLM" in check["fix"]
    assert _check(report, "weights")["status"] == "skip"


def test_model_missing_from_an_offline_cache_fails(tmp_path, monkeypatch, capsys):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    code, report = _doctor(capsys, "nobody/no-such-model")
    assert code == 1
    check = _check(report, "model")
    assert check["status"] == "fail"
    assert "HF_HUB_OFFLINE" in check["detail"] and str(hub) in check["detail"]
    assert "hf download nobody/no-such-model" in check["fix"]
    assert "pass a directory" in check["fix"]
    assert report["facts"]["hf_cache"]["path"] == str(hub)
    assert not hub.exists()  # nothing was fetched


def test_max_seq_len_too_big_for_memory_fails_and_names_one_that_fits(
    tmp_path, monkeypatch, capsys
):
    model_dir = _write_checkpoint(tmp_path / "long", max_position_embeddings=2**20)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1048576 kB\nMemAvailable:  65536 kB\n")  # 64 MiB
    monkeypatch.setattr(doctor_checks, "MEMINFO_PATH", meminfo)

    cpu = ("--device", "cpu")  # the budget is the host's memory
    code, report = _doctor(capsys, str(model_dir), *cpu, "--max-seq-len", str(2**20))
    assert code == 1
    check = _check(report, "memory")
    assert check["status"] == "fail"
    fit = report["facts"]["model"]["memory"]
    assert fit["budget_bytes"] == 64 * 2**20 and fit["block_size"] == BLOCK_SIZE
    # 2 layers x 2 kv heads x 16 dims x fp32, keys and values, for each of a block's tokens
    assert fit["bytes_per_block"] == 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE
    largest = fit["largest_max_seq_len"]
    assert 0 < largest < 2**20
    assert f"--max-seq-len {largest} or less" in check["fix"]
    blocks = -(-largest // BLOCK_SIZE)
    assert fit["weight_bytes"] + blocks * fit["bytes_per_block"] <= fit["budget_bytes"]
    assert fit["weight_bytes"] + (blocks + 1) * fit["bytes_per_block"] > fit["budget_bytes"]

    code, report = _doctor(
        capsys, str(model_dir), *cpu, "--max-seq-len", str(largest), "--kv-cache-memory", "8MiB"
    )
    assert _check(report, "memory")["status"] == "ok"
    assert _check(report, "kv pool")["status"] == "warn"  # 8 MiB holds fewer tokens
    assert "--kv-cache-memory" in _check(report, "kv pool")["fix"]
    assert code == 0


def test_kv_pool_larger_than_memory_fails(tiny_dir, tmp_path, monkeypatch, capsys):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:  65536 kB\n")
    monkeypatch.setattr(doctor_checks, "MEMINFO_PATH", meminfo)
    code, report = _doctor(capsys, str(tiny_dir), "--device", "cpu", "--kv-cache-memory", "1GiB")
    assert code == 1
    check = _check(report, "kv pool")
    assert check["status"] == "fail" and "lower --kv-cache-memory" in check["fix"]
    assert _check(report, "memory")["status"] == "ok"


def test_port_in_use_is_reported(tiny_dir, capsys):
    with contextlib.closing(socket.socket()) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, report = _doctor(capsys, str(tiny_dir), "--port", str(port))
    assert code == 1
    check = _check(report, "port")
    assert check["status"] == "fail"
    assert f"port {port} is in use" in check["fix"] and "--port" in check["fix"]
    assert [c["name"] for c in report["checks"] if c["status"] == "fail"] == ["port"]


def test_corrupt_config_fails_cleanly_in_text(tmp_path, capsys):
    shutil.copytree(demo_tokenizer_dir(), tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], ')
    code = main(["doctor", str(tmp_path), "--port", str(_free_port())])
    out, err = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in out + err
    lines = out.splitlines()
    (config_line,) = [line for line in lines if line.split()[1:2] == ["config"]]
    assert config_line.split()[0] == "FAIL" and "is not valid JSON" in config_line
    fix_line = lines[lines.index(config_line) + 1]
    assert fix_line.split() == ["fix:", "re-download", "the", "checkpoint"]
    # one line per check, the detail column aligned
    rows = [re.match(r"  (ok|warn|FAIL|skip) +(\S+(?: \S+)*)  +(\S.*)", line) for line in lines]
    checks = [row for row in rows if row]
    assert len(checks) >= 15 and {row.group(2) for row in checks} >= {"python", "port", "config"}
    assert len({row.start(3) for row in checks}) == 1
    assert lines[-1].startswith("1 failed (config)")


def test_bad_flag_fails_its_check_not_the_command(tiny_dir, capsys):
    code, report = _doctor(capsys, str(tiny_dir), "--max-seq-len", "4096")
    assert code == 1
    check = _check(report, "engine config")
    assert check["status"] == "fail" and "max_position_embeddings (1024)" in check["detail"]
    assert check["fix"]
    assert _check(report, "memory")["status"] == "skip"
    assert _check(report, "chat template")["status"] == "ok"  # independent of the flag
