"""How `met serve` starts its engine: first, from its flags, before it imports torch."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from metrale.engine.allocator import engine_runs_on_cpu
from metrale.engine.client import EngineClient, EngineDeadError
from metrale.engine.spawn import EngineSpec
from metrale.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[2]


def _run_script(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_the_engine_is_launched_before_the_api_process_imports_torch(qwen3_dir: Path):
    """The two interpreters' imports (seconds each with CUDA's torch) overlap only if the engine
    process starts before this one imports torch: the real CLI, stopped at the launch."""
    result = _run_script(
        f"""
        import os, sys
        from metrale.engine.client import EngineClient

        def launch(cls, engine, *, in_process=False):
            print("torch imported:", "torch" in sys.modules)
            print("launched:", type(engine).__name__, engine.model_dir)
            sys.stdout.flush()
            os._exit(0)

        EngineClient.launch = classmethod(launch)
        from metrale.entrypoints.cli import main
        main(["serve", "--model-from-path", {str(qwen3_dir)!r}, "--device", "cpu"])
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch imported: False" in result.stdout
    assert f"launched: EngineSpec {qwen3_dir}" in result.stdout


def test_the_engine_resolves_its_flags_as_the_api_process_does(qwen3_dir: Path):
    args = EngineArgs(model_from_path=str(qwen3_dir), max_num_seqs=4, kv_cache_memory="8MiB")
    config = args.create_config()

    async def run() -> EngineClient:
        client = EngineClient.launch(EngineSpec(args, config.model_dir))
        await client.ready(config)
        return client

    client = asyncio.run(run())
    try:
        assert client.config == config  # the CPU pool is sized by the flag, on both sides
        assert client.kv_cache is not None and client.kv_cache.num_blocks == config.cache.num_blocks
    finally:
        asyncio.run(client.shutdown())


def test_flags_the_engine_cannot_resolve_end_its_start_in_one_line(qwen3_dir: Path, capfd):
    """What the API process also checks fails in the engine quietly: said once, not twice."""
    good = EngineArgs(model_from_path=str(qwen3_dir))
    bad = EngineArgs(model_from_path=str(qwen3_dir), max_seq_len=10**9)

    async def run() -> None:
        client = EngineClient.launch(EngineSpec(bad, qwen3_dir))
        await client.ready(good.create_config())

    with pytest.raises(EngineDeadError, match=r"ValueError: max_seq_len=1000000000 exceeds"):
        asyncio.run(run())
    assert "max_seq_len" not in capfd.readouterr().err  # the engine process logged nothing of it


def test_an_engine_that_fails_to_start_ends_met_serve_with_its_reason(qwen3_dir: Path):
    """A failure only the engine finds (here, a scripted one) ends `met serve` with exit code 1
    and one error line, after the engine's own log of it."""
    result = _run_script(
        f"""
        import sys
        from metrale.engine.core import EngineCore

        def fail(*args, **kwargs):
            raise RuntimeError("the device fell off the bus")

        EngineCore.from_config = fail
        from metrale.entrypoints.cli import main
        sys.exit(main(["serve", "--model-from-path", {str(qwen3_dir)!r}, "--device", "cpu",
                       "--engine-in-thread", "--port", "0"]))
        """
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("met serve: error:") == 1
    assert (
        "met serve: error: the engine core failed: RuntimeError: the device fell off the bus"
        in result.stderr
    )


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_the_allocator_is_chosen_for_the_device_torch_would_pick(device: str):
    runs_on_cpu = not torch.cuda.is_available() if device == "auto" else device == "cpu"
    assert engine_runs_on_cpu(device) == runs_on_cpu


def test_the_engine_process_ends_without_a_teardown_report(
    qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Ctrl-C ends the server and its engine process quietly: no "leaked instances" report of
    nanobind (Triton's bindings, loaded by torch.compile's CPU decode steps) from the
    interpreter's teardown, no leaked semaphore."""
    from tests.server.conftest import start_server, stop_server

    monkeypatch.setenv("METRALE_COMPILE_CPU_DECODE", "1")  # as `met serve` runs by default
    server = start_server(qwen3_dir, tmp_path / "server.log")
    engine_pid = server.engine_pid()
    code = stop_server(server, signal.SIGINT)
    log = server.log()
    assert code == 0, log
    assert "leaked" not in log and "Traceback" not in log, log
    assert not _alive(engine_pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("sig", "code", "says"),
    [(signal.SIGINT, 130, "interrupted while starting"), (signal.SIGTERM, 143, "terminated")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stop_while_the_engine_starts_ends_met_serve_quietly(
    qwen3_dir: Path, tmp_path: Path, sig: signal.Signals, code: int, says: str
):
    """Ctrl-C or SIGTERM before the server serves: its exit code and one line, no traceback;
    the engine process, stopped mid-start, runs its exit handlers (no leaked semaphore) and is
    gone. (The stop lands at the API process's next await, which a busy machine can delay past
    the tiny engine's load: then the engine is stopped once ready, which must end alike.)"""
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(qwen3_dir),
             "--port", "0", "--device", "cpu"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )  # fmt: skip
    try:
        engine_pid = None
        for _ in range(3000):  # the launch's log line, well before the engine is ready
            if m := re.search(r"engine core process (\d+) started", log_path.read_text()):
                engine_pid = int(m[1])
                break
            time.sleep(0.01)
        assert engine_pid is not None, log_path.read_text()
        process.send_signal(sig)
        try:
            exit_code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:  # (a rare flake under load: keep what it said)
            pytest.fail(f"met serve still running 60 s after {sig.name}:\n{log_path.read_text()}")
    finally:
        if process.poll() is None:
            process.kill()
    log = log_path.read_text()
    assert exit_code == code, log
    assert says in log and "serving " not in log, log
    assert "Traceback" not in log and "leaked" not in log, log
    assert not _alive(engine_pid)
