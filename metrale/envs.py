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
