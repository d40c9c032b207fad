"""Drive the real OpenAI Codex CLI (`codex exec`) against a local Responses API.

Codex is an npm package (`npm install -g @openai/codex@0.169.0`) that ships a
native binary; tests that need it skip when `codex_binary()` returns None.

Each run is isolated: CODEX_HOME is the directory handed to
`write_codex_config`, HOME is a folder inside it, no OPENAI_* / CODEX_* / proxy
variables are inherited, and the config turns off everything that would reach
the network on its own (update check, analytics, feedback, OpenTelemetry,
plugins, apps, web search), so the only traffic is to `base_url`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

PROVIDER_ID = "metrale"
# Environment variable naming a codex executable to use instead of the one on PATH.
CODEX_BIN_ENV = "METRALE_CODEX_BIN"
# The version the captured fixture (fixtures/codex_requests.json) came from.
CAPTURED_VERSION = "0.169.0"

# A short system prompt for `lean` configs: Codex's own is about 17,000 characters.
LEAN_INSTRUCTIONS = (
    "You are a coding agent. Use the exec_command tool to run shell commands "
    "when the user asks for one; otherwise answer briefly."
)

_INHERITED = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR")


@lru_cache(maxsize=1)
def codex_binary() -> str | None:
    """The codex executable (METRALE_CODEX_BIN, else `codex` on PATH) if it runs, else None."""
    candidate = os.environ.get(CODEX_BIN_ENV) or shutil.which("codex")
    if not candidate:
        return None
    try:
        probe = subprocess.run(
            [candidate, "--version"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if probe.returncode != 0 or "codex" not in probe.stdout.lower():
        return None
    return candidate


def codex_version() -> str | None:
    """The version string of codex_binary(), e.g. "0.169.0"."""
    binary = codex_binary()
    if binary is None:
        return None
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return out.strip().split()[-1] if out.strip() else None


def _toml_str(value: str) -> str:
    # JSON string escapes are valid TOML basic-string escapes.
    return json.dumps(value)


def write_codex_config(
    home: Path,
    base_url: str,
    model: str,
    api_key_env: str,
    *,
    context_window: int | None = None,
    auto_compact_token_limit: int | None = None,
    lean: bool = False,
    retries: int = 0,
    stream_idle_timeout_ms: int = 300_000,
    extra_top_level: str = "",
) -> None:
    """Write `home/config.toml` (home is the CODEX_HOME) for a custom Responses provider.

    base_url ends in /v1: Codex posts to f"{base_url}/responses" and calls nothing else.
    `retries` sets both request_max_retries and stream_max_retries (Codex's defaults are
    4 and 5, with backoff: a broken stream would be retried silently, so tests use 0).
    `lean` shrinks the request from ~39 kB to ~5 kB (short system prompt, no skills,
    environment context, sub-agent, goal or request_user_input tools) for small
    context windows; the tools left are exec_command, write_stdin and view_image.
    `extra_top_level` is raw TOML placed with the top-level keys.
    """
    home.mkdir(parents=True, exist_ok=True)
    top = [
        f"model = {_toml_str(model)}",
        f"model_provider = {_toml_str(PROVIDER_ID)}",
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        "check_for_update_on_startup = false",
        'web_search = "disabled"',
    ]
    if context_window is not None:
        top.append(f"model_context_window = {int(context_window)}")
    if auto_compact_token_limit is not None:
        top.append(f"model_auto_compact_token_limit = {int(auto_compact_token_limit)}")
    if lean:
        instructions = home / "instructions.md"
        instructions.write_text(LEAN_INSTRUCTIONS + "\n")
        top += [
            f"model_instructions_file = {_toml_str(str(instructions))}",
            "include_environment_context = false",
            "include_apps_instructions = false",
            "include_collaboration_mode_instructions = false",
        ]
    if extra_top_level:
        top.append(extra_top_level.strip())

    tables = [
        "[analytics]\nenabled = false",
        "[feedback]\nenabled = false",
        '[otel]\nexporter = "none"',
        '[history]\npersistence = "none"',
    ]
    features = ["plugins = false", "apps = false"]
    if lean:
        tables += [
            "[skills]\ninclude_instructions = false",
            "[agents]\nenabled = false",
            "[tools.experimental_request_user_input]\nenabled = false",
        ]
        features.append("goals = false")
    tables.append("[features]\n" + "\n".join(features))
    tables.append(
        "\n".join(
            [
                f"[model_providers.{PROVIDER_ID}]",
                f"name = {_toml_str(PROVIDER_ID)}",
                f"base_url = {_toml_str(base_url.rstrip('/'))}",
                'wire_api = "responses"',
                f"env_key = {_toml_str(api_key_env)}",
                f"request_max_retries = {int(retries)}",
                f"stream_max_retries = {int(retries)}",
                f"stream_idle_timeout_ms = {int(stream_idle_timeout_ms)}",
            ]
        )
    )
    text = "\n".join(top) + "\n\n" + "\n\n".join(tables) + "\n"
    tomllib.loads(text)  # fail here, not inside codex, on a malformed extra_top_level
    (home / "config.toml").write_text(text)


@dataclass
class CodexRun:
    returncode: int
    stdout: str
    stderr: str
    last_message: str | None
    timed_out: bool = False
    # `codex exec --json` events, one per stdout line (thread.started, turn.started,
    # item.started/item.completed, turn.completed / turn.failed, error).
    events: list[dict[str, Any]] = field(default_factory=list)

    def items(self, item_type: str | None = None) -> list[dict[str, Any]]:
        """Completed items (agent_message, reasoning, command_execution, error, ...)."""
        return [
            e["item"]
            for e in self.events
            if e.get("type") == "item.completed"
            and (item_type is None or e["item"].get("type") == item_type)
        ]

    @property
    def agent_messages(self) -> list[str]:
        return [item.get("text", "") for item in self.items("agent_message")]

    @property
    def commands(self) -> list[dict[str, Any]]:
        """command_execution items: command, aggregated_output, exit_code, status."""
        return self.items("command_execution")

    @property
    def usage(self) -> dict[str, Any] | None:
        done = [e for e in self.events if e.get("type") == "turn.completed"]
        return done[-1].get("usage") if done else None

    @property
    def errors(self) -> list[str]:
        out = [e.get("message", "") for e in self.events if e.get("type") == "error"]
        out += [
            (e.get("error") or {}).get("message", "")
            for e in self.events
            if e.get("type") == "turn.failed"
        ]
        return out

    def describe(self) -> str:
        """Everything useful for an assertion message."""
        return (
            f"returncode={self.returncode} timed_out={self.timed_out}\n"
            f"last_message={self.last_message!r}\n--- stdout\n{self.stdout}\n"
            f"--- stderr\n{self.stderr[-4000:]}"
        )


def _api_key_env(home: Path) -> str:
    config = tomllib.loads((home / "config.toml").read_text())
    return config["model_providers"][PROVIDER_ID]["env_key"]


def codex_env(home: Path, env_key_value: str) -> dict[str, str]:
    """The whole environment of a codex run: nothing from OPENAI_*, CODEX_* or proxies."""
    env = {k: os.environ[k] for k in _INHERITED if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    user_home = home / "home"
    user_home.mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(user_home),
        CODEX_HOME=str(home),
        TERM="dumb",
        NO_COLOR="1",
        RUST_LOG="error",
        NO_PROXY="*",
        no_proxy="*",
    )
    env[_api_key_env(home)] = env_key_value
    return env


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def run_codex_exec(
    home: Path,
    prompt: str,
    cwd: Path,
    env_key_value: str,
    timeout: float = 120,
    *,
    extra_args: tuple[str, ...] = (),
    strict_config: bool = True,
) -> CodexRun:
    """`codex exec --json -o FILE PROMPT` in cwd with CODEX_HOME=home; never raises on failure.

    On timeout the whole process group is killed and timed_out is set.
    """
    binary = codex_binary()
    if binary is None:
        raise RuntimeError("codex is not installed (npm install -g @openai/codex@0.169.0)")
    cwd.mkdir(parents=True, exist_ok=True)
    last_file = home / "last_message.txt"
    last_file.unlink(missing_ok=True)
    cmd = [
        binary,
        "exec",
        "--json",
        "--skip-git-repo-check",
        "--ephemeral",
        "--color",
        "never",
        "--output-last-message",
        str(last_file),
        "-C",
        str(cwd),
    ]
    if strict_config:
        cmd.append("--strict-config")
    cmd += [*extra_args, "--", prompt]
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=codex_env(home, env_key_value),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
    events = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    last = last_file.read_text() if last_file.exists() else None
    return CodexRun(
        returncode=proc.returncode,
        stdout=stdout,
        stderr=stderr,
        last_message=last,
        timed_out=timed_out,
        events=events,
    )
