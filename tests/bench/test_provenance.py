"""bench/provenance.py's package tree hash is git's own: a result file names the package that ran
even where the device's checkout carries a stale `.git`, and `git rev-parse <commit>:metrale`
finds the commit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_provenance():
    spec = importlib.util.spec_from_file_location("provenance", ROOT / "bench" / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git(cwd: Path, *args: str) -> str:
    run = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout.strip()


def test_the_tree_hash_is_gits(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub" / "deeper").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "a-b.py").write_text("dash sorts before the directory\n")
    (pkg / "sub" / "m.py").write_bytes(b"\x00binary\xff")
    (pkg / "sub" / "deeper" / "n.toml").write_text("k = 2\n")
    (pkg / "sub.txt").write_text("a file named like the directory\n")
    run = pkg / "run.sh"
    run.write_text("#!/bin/sh\n")
    os.chmod(run, 0o755)
    (tmp_path / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "c")
    # What a run leaves that git ignores or cannot hold: the hash must not see it.
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"cache")
    (pkg / "empty").mkdir()
    provenance = load_provenance()
    assert provenance.tree_hash(pkg) == git(tmp_path, "rev-parse", "HEAD:pkg")
    (pkg / "sub" / "m.py").write_text("changed\n")
    assert provenance.tree_hash(pkg) != git(tmp_path, "rev-parse", "HEAD:pkg")


def test_metrale_tree_names_the_imported_package():
    provenance = load_provenance()
    import metrale

    expected = provenance.tree_hash(Path(metrale.__file__).parent)[:12]
    assert provenance.metrale_tree() == expected
