"""The memory allocator of the engine-core process on a CPU.

A CPU step allocates its activations afresh for every op, megabytes each in a prefill. glibc's
malloc hands such blocks back to the kernel when they are freed and the next op faults its
pages in again; tcmalloc keeps them. Measured on a 2-core VM (bench/profile_cpu.py's model, a
2,048-token prefill step): SiLU of the [2048, 1536] gate 15-17 ms under glibc (its mmap and trim
thresholds tuned or not), 1.2 ms under tcmalloc; the whole step ~10% faster. vLLM's CPU guide
asks users to preload tcmalloc by hand; `met serve` does it for the engine process it spawns,
where the system has the library (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`).
"""

from __future__ import annotations

import contextlib
import ctypes.util
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

KNOWN = ("tcmalloc", "jemalloc", "mimalloc")


def preloaded_allocator() -> str:
    """The allocator LD_PRELOAD puts first ("glibc" if none)."""
    libs = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    names = [os.path.basename(lib) for lib in libs]
    return next((n for n in names if any(k in n for k in KNOWN)), "glibc")


def tcmalloc_library() -> str | None:
    """The system's tcmalloc, as a name LD_PRELOAD finds (None if absent)."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        if (found := ctypes.util.find_library(name)) is not None:
            return found
    return None


@contextlib.contextmanager
def engine_process_allocator(use_tcmalloc: bool) -> Iterator[str]:
    """Around the start of the engine process: LD_PRELOAD names tcmalloc, when `use_tcmalloc`,
    the system has it and no allocator is preloaded already; yields the allocator the process
    gets. This process's environment is as it was afterwards."""
    library = tcmalloc_library() if use_tcmalloc else None
    if library is None or preloaded_allocator() != "glibc":
        yield preloaded_allocator()
        return
    before = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{library} {before}" if before else library
    try:
        yield library
    finally:
        if before is None:
            del os.environ["LD_PRELOAD"]
        else:
            os.environ["LD_PRELOAD"] = before


def engine_runs_on_cpu(device: str) -> bool:
    """Whether `--device` resolves to a CPU, told without importing torch: the allocator must be
    chosen before the engine process starts, which `met serve` does before it imports torch.
    `auto` is a GPU where torch is a CUDA build and a GPU is visible: a device file of the
    NVIDIA driver, and CUDA_VISIBLE_DEVICES not empty (asking the driver itself, cuInit, cost
    0.25 s of an H200 server's start)."""
    if device != "auto":
        return device.partition(":")[0] == "cpu"
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return True
    if not any((Path(spec.origin).parent / "lib").glob("libtorch_cuda*")):
        return True  # a CPU build of torch
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return True
    return not any(Path("/dev").glob("nvidia[0-9]*"))
