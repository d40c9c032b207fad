"""A `met serve` this benchmark starts for itself: on a free loopback port, its output in a log
file, up once `/health` answers, stopped (SIGINT, then SIGKILL) when the benchmark is done."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx


class ServerProcess:
    def __init__(self, serve_args: list[str], log_path: Path, *, start_timeout: float = 600.0):
        self.serve_args = serve_args
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None
        self.base_url = ""

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "metrale", "serve", *self.serve_args]

    def __enter__(self) -> ServerProcess:
        port = _free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [*self.command, "--bind", "127.0.0.1", "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ | {"PYTHONUNBUFFERED": "1"},
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ValueError(
                    f"met serve exited with status {self.process.returncode} before it was up; "
                    f"its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ValueError(
            f"met serve was not up within {self.start_timeout:g} s; its log ({self.log_path}) "
            f"ends:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)  # the server's own graceful shutdown
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
