"""Which code a benchmark ran: the commit every result file records, and the package's tree.

`GIT_SHA` where the caller sets it: a device machine's copy of the checkout may carry the
`.git` of an older commit than the files it ran. Else this checkout's HEAD, with `+dirty` where
tracked files differ from it (the figures are then not that commit's).

`metrale_tree()` needs no `.git`: the git tree hash of the `metrale` package Python imports (a
before/after run's `PYTHONPATH=bench/.baseline` included), which `git rev-parse <commit>:metrale`
prints for each commit that has exactly those files."""

from __future__ import annotations

import hashlib
import importlib.util
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


# What .gitignore keeps out of a checkout's package (and so out of its tree hash).
_IGNORED_DIRS = ("__pycache__",)
_IGNORED_SUFFIXES = (".pyc", ".log", ".egg-info")


def metrale_tree() -> str:
    """The short git tree hash of the `metrale` directory this interpreter imports."""
    spec = importlib.util.find_spec("metrale")
    assert spec is not None and spec.origin is not None, "metrale is not importable"
    sha = tree_hash(Path(spec.origin).parent)
    assert sha is not None, "the metrale package holds no files"
    return sha[:12]


def tree_hash(directory: Path) -> str | None:
    """Git's object id of `directory` as a tree: what `git rev-parse <commit>:<path>` prints
    when the commit holds exactly these files (ignored names skipped); None where no file is
    left, as git has no empty trees (such a subdirectory is no entry of its parent)."""
    entries = []
    for path in directory.iterdir():
        if path.name in _IGNORED_DIRS or path.name.endswith(_IGNORED_SUFFIXES):
            continue
        if path.is_dir():
            if (sha := tree_hash(path)) is not None:
                entries.append((path.name + "/", b"40000 " + path.name.encode(), sha))
        elif path.is_file():
            mode = b"100755" if os.access(path, os.X_OK) else b"100644"
            sha = _object_id(b"blob", path.read_bytes())
            entries.append((path.name, mode + b" " + path.name.encode(), sha))
    if not entries:
        return None
    body = b"".join(head + b"\0" + bytes.fromhex(sha) for _, head, sha in sorted(entries))
    return _object_id(b"tree", body)


def _object_id(kind: bytes, data: bytes) -> str:
    return hashlib.sha1(kind + b" " + str(len(data)).encode() + b"\0" + data).hexdigest()
