"""`met` on the command line."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine_args import EngineArgs
from metrale.entrypoints.cli import build_parser, main


def test_generate_prints_the_greedy_text(qwen3_dir, capsys):
    code = main(
        [
            "generate",
            "Hello there",
            "--model-from-path",
            str(qwen3_dir),
            "--max-tokens",
            "6",
            "--dtype",
            "float32",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    expected = (
        LLM(model_from_path=str(qwen3_dir))
        .generate("Hello there", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    assert printed == expected + "\n"


def test_bad_flag_value_is_a_clear_error_not_a_traceback(qwen3_dir, capsys):
    code = main(["generate", "x", "--model-from-path", str(qwen3_dir), "--max-tokens", "0"])
    assert code == 2
    assert "max_tokens=0 is out of range" in capsys.readouterr().err


def test_help_explains_every_flag():
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    assert {"generate", "serve"} <= set(subcommands)
    assert {"bench", "doctor", "sync-recipes"} <= set(subcommands)

    def check(name: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if action.dest != "help":
                assert action.help, f"met {name} {action.option_strings or action.dest}: no help"
            if isinstance(action, argparse._SubParsersAction):  # met bench serve, ...
                for mode, sub in action.choices.items():
                    check(f"{name} {mode}", sub)

    for name, sub in subcommands.items():
        check(name, sub)
    result = subprocess.run(
        [sys.executable, "-m", "metrale", "--help"], capture_output=True, text=True, check=True
    )
    assert "generate" in result.stdout


def test_kv_cache_dtype_flag_sizes_the_pool(qwen3_dir):
    """--kv-cache-dtype fp8 stores a byte per value: four times the blocks of an fp32 pool in
    the same --kv-cache-memory."""
    parser = build_parser()
    flags = ["serve", "--model-from-path", str(qwen3_dir), "--kv-cache-memory", "4MiB"]
    configs = {
        name: EngineArgs.from_cli(
            parser.parse_args([*flags, "--dtype", "float32", "--kv-cache-dtype", name])
        ).create_config()
        for name in ("auto", "fp8", "fp8_e5m2")
    }
    assert configs["auto"].cache.dtype == torch.float32
    assert configs["fp8"].cache.dtype == torch.float8_e4m3fn
    assert configs["fp8_e5m2"].cache.dtype == torch.float8_e5m2
    assert configs["fp8"].cache.num_blocks == 4 * configs["auto"].cache.num_blocks
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not supported"):
        EngineArgs(model_from_path=str(qwen3_dir), kv_cache_dtype="int4").create_config()


def test_prefill_budget_defaults_by_device(qwen3_dir, monkeypatch):
    """8,192 prompt tokens a step on a GPU (host-bound steps below that), 256 on CPU; the flag
    wins on both, and the step's whole budget adds a token per batched request."""
    from metrale import engine_config

    parser = build_parser()
    flags = ["serve", "--model-from-path", str(qwen3_dir), "--max-num-seqs", "16"]
    cpu = EngineArgs.from_cli(parser.parse_args(flags)).create_config().scheduler
    assert (cpu.max_prefill_tokens, cpu.max_num_batched_tokens) == (256, 256 + 16)
    chosen = [*flags, "--max-prefill-tokens", "100"]
    assert EngineArgs.from_cli(parser.parse_args(chosen)).create_config().scheduler == (
        dataclasses.replace(cpu, max_prefill_tokens=100, max_num_batched_tokens=116)
    )
    monkeypatch.setattr(engine_config, "_resolve_device", lambda name: torch.device("cuda"))
    gpu = EngineArgs.from_cli(parser.parse_args(flags)).create_config().scheduler
    assert (gpu.max_prefill_tokens, gpu.max_num_batched_tokens) == (8192, 8192 + 16)


@pytest.mark.parametrize(
    ("flags", "word"),
    [
        (["--response-store", "redis://x"], "sqlite:PATH"),
        (["--response-store-max-entries", "0"], "max_entries"),
        (["--response-store-ttl", "-1"], "ttl"),
    ],
)
def test_bad_response_store_flags_stop_before_the_weights_load(qwen3_dir, tmp_path, flags, word):
    result = subprocess.run(
        [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(qwen3_dir), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert word in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_a_file_that_is_not_a_database_is_a_clear_error(qwen3_dir, tmp_path):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("not a database, just words " * 100)
    result = subprocess.run(
        [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(qwen3_dir),
         "--response-store", f"sqlite:{bogus}"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert str(bogus) in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_a_subcommand_parses_alike_with_its_parser_alone():
    """`met serve ...` builds only serve's parser (its start imports nothing of the other
    subcommands): every subcommand is known by the names that choose it, and parses the same."""
    from metrale import entrypoints

    full = build_parser()
    names = full._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(names) == set(entrypoints.cli._MODULES)
    argv = ["serve", "--port", "9", "--max-num-seqs", "3", "--tool-call-parser", "hermes"]
    alone = build_parser("serve")
    assert list(alone._subparsers._group_actions[0].choices) == ["serve"]  # type: ignore[union-attr]
    assert vars(alone.parse_args(argv)) == vars(full.parse_args(argv))


@pytest.mark.parametrize(("value", "message"), [("0", "must be at least 1"), ("x", "not a whole")])
def test_a_stream_interval_that_is_no_count_of_tokens_is_a_usage_error(capsys, value, message):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--stream-interval", value])
    assert exit_info.value.code == 2
    assert f"--stream-interval: {message}" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--stream-interval", "4"]).stream_interval == 4
