"""`met serve --tui` in a real pseudo-terminal: the dashboard draws there while the server
serves; `q` stops the server; a terminal that goes away leaves it serving."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time

import httpx
import pytest

from tests.server.conftest import free_port

pytest.importorskip("textual")


def spawn(model_dir, *extra: str) -> tuple[subprocess.Popen, int, str]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x28\x00\x78\x00\x00\x00\x00\x00")  # 40 x 120
    port = free_port()
    cmd = [sys.executable, "-m", "metrale", "serve", "--model-from-path", str(model_dir)]
    cmd += ["--port", str(port), "--num-kv-blocks", "64", "--max-seq-len", "256", "--tui", *extra]

    def controlling_terminal() -> None:  # the pty is the server's terminal, as in a shell
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    process = subprocess.Popen(
        cmd,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=controlling_terminal,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"},
    )
    os.close(slave)
    return process, master, f"http://127.0.0.1:{port}"


def read_until_healthy(process, master, url, timeout_s=120.0) -> bytes:
    screen = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, screen[-2000:]
        if select.select([master], [], [], 0.2)[0]:
            try:
                screen += os.read(master, 65536)
            except OSError:
                break
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                return screen
        except httpx.HTTPError:
            pass
    raise AssertionError(f"not healthy; the terminal showed:\n{screen[-2000:]!r}")


def drain(master, seconds: float) -> bytes:
    out, end = b"", time.monotonic() + seconds
    while time.monotonic() < end:
        if select.select([master], [], [], 0.1)[0]:
            try:
                out += os.read(master, 65536)
            except OSError:
                break
    return out


# With two API processes the other's output goes to the file too, and its requests reach the
# dashboard over the event bus.
SERVERS = pytest.mark.parametrize("extra", [[], ["--api-server-count", "2"]], ids=["one", "two"])


@SERVERS
def test_the_dashboard_draws_and_q_stops_the_server(qwen3_dir, extra):
    process, master, url = spawn(qwen3_dir, *extra)
    try:
        screen = read_until_healthy(process, master, url)
        body = {"model": str(qwen3_dir), "prompt": "hi", "max_tokens": 4}
        for _ in range(8):  # a connection each: with two processes, both serve some
            assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        screen += drain(master, 2.0)
        # Once serving, the phases fold into one summary line (a phase that starts and ends
        # between two frames, as "listening" can on a busy machine, is never drawn by name).
        assert b"phases done" in screen and b"quit" in screen  # the summary, and the key bar
        # Once the dashboard has the screen (the alternate screen), no log line is printed over
        # it: the engine process's output goes to a file, this process's to the log pane.
        before, dashboard = screen.split(b"\x1b[?1049h", 1)
        assert b"INFO metrale" not in dashboard  # a console line: "<time> INFO metrale.x: ..."
        assert b"engine-core.log" in before
        os.write(master, b"q")
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)


@SERVERS
def test_the_server_keeps_serving_when_its_terminal_goes_away(qwen3_dir, extra):
    process, master, url = spawn(qwen3_dir, *extra)
    try:
        read_until_healthy(process, master, url)
        os.close(master)  # the terminal window is closed: SIGHUP, and a dead tty
        time.sleep(2.0)
        assert process.poll() is None
        body = {"model": str(qwen3_dir), "prompt": "still there?", "max_tokens": 4}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
