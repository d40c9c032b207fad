"""Which code a benchmark ran: the commit every result file records.

`GIT_SHA` where the caller sets it: a device machine's copy of the checkout may carry the
`.git` of an older commit than the files it ran. Else this checkout's HEAD, with `+dirty` where
tracked files differ from it (the figures are then not that commit's)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_sha() -> str:
    if sha := os.environ.get("GIT_SHA"):
        return sha

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO)
        return run.stdout.strip()

    sha = git("rev-parse", "--short", "HEAD")
    dirty = sha and git("status", "--porcelain", "--untracked-files=no")
    return f"{sha}+dirty" if dirty else sha
