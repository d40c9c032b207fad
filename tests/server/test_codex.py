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
from tests.server.conftest import MODEL_NAME, RunningServer, start_server, stop_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(codex_binary() is None, reason="codex CLI not installed (npm)"),
]

GREETING = ("Hello from Metrale.", " harmonic")
API_KEY = "codex-test-key"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> ScriptedCheckpoint:
    replies = {GREETING[1]: GREETING[0]}
    return build_scripted_checkpoint(tmp_path_factory.mktemp("scripted-codex"), replies)


@pytest.fixture(scope="module")
def served(
    scripted: ScriptedCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    running = start_server(
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
    )
    yield running
    code = stop_server(running)
    assert code == 0, f"met serve did not shut down cleanly ({code}):\n{running.log()}"


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
