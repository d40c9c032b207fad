"""Building and loading Metrale's CPU kernels (`kernels/cpu_extension.py`) survives a build that
was stopped: torch's lock file, which a process killed mid-build leaves behind, made every later
load wait on it forever (a `met serve` that hung at startup after a Ctrl-C during its first)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torch.utils.cpp_extension import _get_build_directory

from metrale.kernels import cpu_extension
from tests.conftest import needs_cpu_kernels

pytestmark = needs_cpu_kernels

LOAD = "from metrale.kernels import cpu_extension as c; assert c.available()"


def test_a_lock_left_by_a_stopped_build_does_not_hang_the_next_load():
    assert cpu_extension.available()  # built, as after a first start
    directory = Path(_get_build_directory(cpu_extension.extension_name(), verbose=False))
    lock = directory / "lock"
    lock.write_text("")  # what a build killed while it held torch's lock leaves
    try:
        done = subprocess.run(
            [sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=90
        )
        assert done.returncode == 0, done.stderr
        assert "left by a build that was stopped" in done.stderr
        assert not lock.exists()
    finally:
        lock.unlink(missing_ok=True)


def test_a_build_in_progress_is_waited_for_not_broken():
    """Another process holding the lock (building now) is waited on: its lock file stays until it
    lets go, and the load then succeeds."""
    import fcntl

    assert cpu_extension.available()
    directory = Path(_get_build_directory(cpu_extension.extension_name(), verbose=False))
    with (directory / "metrale.flock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        loader = subprocess.Popen([sys.executable, "-c", LOAD], stderr=subprocess.PIPE, text=True)
        try:
            loader.wait(timeout=10)
            raise AssertionError("the load did not wait for the build in progress")
        except subprocess.TimeoutExpired:
            pass
    _, stderr = loader.communicate(timeout=90)
    assert loader.returncode == 0, stderr
