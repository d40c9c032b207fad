"""Every environment variable Metrale reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where Metrale keeps files it generates (the demo checkpoint): METRALE_CACHE_DIR."""
    if path := os.environ.get("METRALE_CACHE_DIR"):
        return Path(path)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "metrale"


def demo_kind() -> str:
    """Which built-in model runs when none is named: METRALE_DEMO=random forces the random one
    (tiny and fast, for tests of the machinery); unset or "auto", SmolLM2 when installed."""
    kind = os.environ.get("METRALE_DEMO", "auto").strip() or "auto"
    if kind not in ("auto", "random"):
        raise ValueError(f"METRALE_DEMO={kind!r}: use auto or random")
    return kind


def pdl() -> bool:
    """Whether Triton kernels may use programmatic dependent launch on GPUs that have it
    (`metrale.kernels.pdl`): METRALE_PDL=0 turns it off."""
    return os.environ.get("METRALE_PDL", "1") != "0"


def onednn() -> bool:
    """Whether linear layers on a CPU run through packed weights (`layers.linear.prepack_for_cpu`:
    Metrale's panels for float32 where its CPU kernels build, else oneDNN's layout):
    METRALE_ONEDNN=0 keeps torch's default products."""
    return os.environ.get("METRALE_ONEDNN", "1") != "0"


def compile_cpu_decode() -> bool:
    """Whether a CPU engine compiles its decode steps (`runner.compiled_decode`) unless
    `--enforce-eager`: METRALE_COMPILE_CPU_DECODE=0 keeps them eager (the test suite does, so that
    only the tests of the compiled path pay for compiling)."""
    return os.environ.get("METRALE_COMPILE_CPU_DECODE", "1") != "0"


def freeze_heap() -> bool:
    """Whether a process that serves or generates keeps its startup heap out of the garbage
    collector's sweeps and collects its young objects less often (`engine.heap`):
    METRALE_FREEZE_HEAP=0 leaves the heap and the collector as they are (the test suite
    does: it builds hundreds of engines in one process, and the full collection before each
    freeze would walk all of the suite's heap each time)."""
    return os.environ.get("METRALE_FREEZE_HEAP", "1") != "0"


def cpu_kernels() -> bool:
    """Whether a CPU engine runs Metrale's C++ kernels (`kernels.cpu_extension`: packed GGUF
    products in compiled decode steps, paged decode attention in eager ones) where they build:
    METRALE_CPU_KERNELS=0 keeps the torch paths."""
    return os.environ.get("METRALE_CPU_KERNELS", "1") != "0"


def tcmalloc() -> bool:
    """Whether a CPU engine process starts with the system's tcmalloc preloaded
    (`engine.allocator`): METRALE_TCMALLOC=0 keeps glibc's malloc."""
    return os.environ.get("METRALE_TCMALLOC", "1") != "0"


def api_keys() -> list[str]:
    """API keys every `/v1` request must carry one of: METRALE_API_KEY, comma-separated."""
    return [key.strip() for key in os.environ.get("METRALE_API_KEY", "").split(",") if key.strip()]


def positive_int(name: str) -> int | None:
    """An environment variable that holds a count, or None when it is unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")
    return value


def rate_limit_rpm() -> int | None:
    """Requests per minute per API key (per client address without keys): unset, no limit."""
    return positive_int("METRALE_RATE_LIMIT_RPM")


def rate_limit_tpm() -> int | None:
    """Tokens (prompt plus max_tokens, unused refunded) per minute per key: unset, no limit."""
    return positive_int("METRALE_RATE_LIMIT_TPM")


def rate_limit_max_keys() -> int:
    """How many clients the rate limiter remembers (least recently used forgotten first)."""
    return positive_int("METRALE_RATE_LIMIT_MAX_KEYS") or 10_000


def engine_log_file() -> Path | None:
    """Where the engine-core process writes its output instead of the terminal (set by
    `met serve --tui`, whose dashboard owns the terminal): METRALE_ENGINE_LOG_FILE."""
    path = os.environ.get("METRALE_ENGINE_LOG_FILE")
    return Path(path) if path else None
