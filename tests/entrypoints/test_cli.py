"""`met` on the command line."""

from __future__ import annotations

import subprocess
import sys

from metrale import LLM, SamplingParams
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
    for name, sub in subcommands.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"met {name} {action.option_strings or action.dest}: no help"
    result = subprocess.run(
        [sys.executable, "-m", "metrale", "--help"], capture_output=True, text=True, check=True
    )
    assert "generate" in result.stdout
