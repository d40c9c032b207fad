"""OpenAI's Codex CLI, unchanged, against `met serve` (slow: it needs `codex` from npm,
`npm install -g @openai/codex@0.169.0`, and skips without it).

The model is a checkpoint whose weights spell fixed replies (tests/scripted_checkpoint.py), so
what Codex prints is known byte for byte. Codex speaks only streamed `POST /v1/responses`,
stateless (`store: false`, the whole history each turn), through a provider whose `base_url`
is the local server (tests/server/codex_cli.py writes the config).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scripted_checkpoint import ScriptedCheckpoint, build_scripted_checkpoint
from tests.server.codex_cli import codex_binary, run_codex_exec, write_codex_config
from tests.server.conftest import MODEL_NAME, RunningServer, serving

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(codex_binary() is None, reason="codex CLI not installed (npm)"),
]

GREETING = ("Hello from Metrale.", " harmonic")
# A shell command through Codex's exec_command tool, then the answer once its output is back.
COMMAND = "echo metrale > proof.txt"
CALL = (
    '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "' + COMMAND + '"}}\n</tool_call>'
)
AFTER_CALL = "The file is written."
CALL_KEYWORD = " median"
API_KEY = "codex-test-key"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> ScriptedCheckpoint:
    replies = {GREETING[1]: GREETING[0], CALL_KEYWORD: CALL}
    return build_scripted_checkpoint(
        tmp_path_factory.mktemp("scripted-codex"), replies, after_tool={CALL_KEYWORD: AFTER_CALL}
    )


@pytest.fixture(scope="module")
def served(
    scripted: ScriptedCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    with serving(
        scripted.path,
        tmp_path_factory.mktemp("serve-codex") / "server.log",
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "hermes",
        "--max-seq-len",
        "4096",
        "--num-kv-blocks",
        "1024",
        "--api-key",
        API_KEY,
    ) as running:
        yield running


def codex_home(tmp_path: Path, served: RunningServer) -> Path:
    home = tmp_path / "codex-home"
    write_codex_config(
        home, served.api_url, MODEL_NAME, "METRALE_TEST_KEY", lean=True, context_window=4096
    )
    return home


def test_codex_prints_the_models_reply(tmp_path, served):
    work = tmp_path / "work"
    work.mkdir()
    run = run_codex_exec(
        codex_home(tmp_path, served), f"Say hello,{GREETING[1]} please.", work, API_KEY
    )
    assert run.returncode == 0, run.describe() + served.log()[-3000:]
    assert run.last_message == GREETING[0], run.describe()
    assert run.usage and run.usage["input_tokens"] > 0, run.describe()


def test_codex_runs_the_models_function_call_and_sends_its_output_back(tmp_path, served):
    work = tmp_path / "work"
    work.mkdir()
    before = served.log().count("POST /v1/responses 200")
    run = run_codex_exec(
        codex_home(tmp_path, served), f"Write the proof file,{CALL_KEYWORD} please.", work, API_KEY
    )
    assert run.returncode == 0, run.describe() + served.log()[-3000:]
    assert (work / "proof.txt").read_text() == "metrale\n", run.describe()
    (command,) = run.commands
    assert COMMAND in command["command"] and command["exit_code"] == 0
    # Two turns: the call, then the answer to its output.
    assert served.log().count("POST /v1/responses 200") - before == 2
    # The answer is the one written after the tool result: Codex sent function_call_output.
    assert run.last_message == AFTER_CALL, run.describe()
