"""One-row products over packed GGUF weights on a CPU: a C++ kernel that reads Q8_0, Q4_0 and Q4_1
blocks as they lie (`kernels/quant_layout.py`), for the compiled one-row decode steps
(`runner/compiled_decode.py`).

A one-row step reads every weight once, so its time is the bytes it reads. Served dequantized, a
GGUF's weights are float32: SmolLM2-135M's Q4_1 file (97 MB) becomes 540 MB a step. Read packed,
the step reads the file's bytes. Inductor's own loops over the nibbles did not vectorize (1-3
GB/s on 2 cores), and aten's int4 CPU product ran 0.8 GB/s, so the product is this kernel:
per 32-value block, the weights turned to float32 in registers and multiplied against the
activation, `d * (q . x) + m * sum(x)`, in float32 throughout (the values are those of the
dequantized weight, only the order of the sums differs).

It is compiled on first use by torch's C++ extension builder (g++, `-O3 -march=native
-fopenmp`: ~25 s on 2 cores), cached on disk per machine, and registered as the op
`metrale_cpu::packed_gemv`, which a compiled graph calls as it is. `available()` is False where
it cannot be built (no compiler): the steps then read the dense weights.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

from metrale.kernels.quant_layout import FORMAT_IDS

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "cpu" / "packed_gemv.cpp"
_traceable = False  # the op's fake (tracing) implementation is registered


def _machine_tag() -> str:
    """A short hash of what `-march=native` compiles for: the build is cached per machine kind."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


@functools.cache
def available() -> bool:
    """Whether the kernel is built and its op registered (built now if need be, once a process)."""
    from torch.utils.cpp_extension import load_inline

    source = _SOURCE.read_text()
    name = f"metrale_cpu_packed_{hashlib.sha256(source.encode()).hexdigest()[:10]}_{_machine_tag()}"
    logger.info("loading the CPU kernel for packed GGUF weights (built once a machine, ~25 s)")
    try:
        load_inline(
            name,
            cpp_sources=source,
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: whatever the builder raises
        logger.warning(
            "could not build the CPU kernel for packed GGUF weights, one-row steps read them "
            "dequantized: %s: %s",
            type(e).__name__,
            str(e).strip().splitlines()[0] if str(e).strip() else "",
        )
        return False
    global _traceable
    if not _traceable:  # once a process, however often the build is looked up again
        torch.library.register_fake("metrale_cpu::packed_gemv")(_fake)
        _traceable = True
    return True


def _fake(x, qweight, scales, mins, fmt):
    """The op's output, for tracing: [rows of x, rows of the weight]."""
    return x.new_empty((x.shape[0], scales.shape[0]))


def packed_gemv(
    x: torch.Tensor, fmt: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """x [1, K] float32 @ dequant(weight).T, the weight's parts as `PackedWeight` holds them."""
    return torch.ops.metrale_cpu.packed_gemv(x, qweight, scales, mins, FORMAT_IDS[fmt])
