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


def pdl() -> bool:
    """Whether Triton kernels may use programmatic dependent launch on GPUs that have it
    (`metrale.kernels.pdl`): METRALE_PDL=0 turns it off."""
    return os.environ.get("METRALE_PDL", "1") != "0"
