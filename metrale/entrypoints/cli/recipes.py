"""`met sync-recipes [SOURCE]`: fill the local recipe index that `met serve` consults before
the shipped recipes (`metrale.recipes.sync` has the rules).

Exit status: 0 when every recipe of the source installed, 1 when some were rejected (the others
installed), 2 when the source could not be read or the index not written (nothing changed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from metrale.entrypoints.cli import Subcommand, register
from metrale.recipes import local_index_dir
from metrale.recipes.sync import Status, SyncError, SyncReport, recorded_source, sync_recipes

EXIT_OK = 0
EXIT_SOME_REJECTED = 1  # the sync ran; a recipe failed its check and was not installed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        nargs="?",
        help="a directory of *.toml recipes (its recipes/ folder if it has one), a git "
        "repository (a local path, file://, git@..., or a URL ending .git), a Hugging Face model "
        "repo ORG/NAME[@REVISION], or an http(s) URL of a .tar.gz/.tgz/.tar (default: the "
        "source the index was last synced from)",
    )
    parser.add_argument(
        "--index",
        type=Path,
        metavar="DIR",
        help="the index to fill (default: METRALE_RECIPES_DIR, else recipes/ in "
        "METRALE_CACHE_DIR, else $XDG_CACHE_HOME/metrale/recipes, else ~/.cache/metrale/recipes)",
    )
    parser.add_argument(
        "--revision", help="a git branch or tag, or a Hugging Face revision (default: the main one)"
    )
    parser.add_argument(
        "--prune",
        action="store_true",
        help="remove recipes from the index that the source no longer has (default: keep them)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args: argparse.Namespace) -> int:
    index_dir = args.index if args.index is not None else local_index_dir()
    source, revision = args.source, args.revision
    if source is None:
        recorded = recorded_source(index_dir)
        if recorded is None:
            raise SyncError(
                f"no SOURCE given and the index {index_dir} was never synced: name a directory, "
                f"a git repository, a Hugging Face id (ORG/NAME) or a tarball URL"
            )
        source, revision = recorded.location, revision or recorded.revision
    report = sync_recipes(source, index_dir, revision=revision, prune=args.prune)
    print(json.dumps(report_json(report)) if args.json else format_report(report))
    return EXIT_SOME_REJECTED if report.num_rejected else EXIT_OK


def report_json(report: SyncReport) -> dict[str, object]:
    spec = report.source
    return {
        "source": {"kind": spec.kind.value, "location": spec.location, "revision": spec.revision},
        "index": str(report.index_dir),
        "files": [
            {"name": f.name, "status": f.status.value, "reason": f.reason} for f in report.files
        ],
    }


def format_report(report: SyncReport) -> str:
    """A line per file, status first: `added  qwen3.toml`, `rejected  bad.toml  (why)`."""
    spec = report.source
    at = f"@{spec.revision}" if spec.revision else ""
    lines = [f"synced {spec.kind.value} {spec.location}{at} into {report.index_dir}"]
    if not report.files:
        lines.append("  (no recipes: the source has no *.toml at its top level or in recipes/)")
    width = max((len(f.name) for f in report.files), default=0)
    for f in report.files:
        why = f"  ({f.reason})" if f.reason else ""
        lines.append(f"  {f.status.value:<9}  {f.name:<{width}}{why}")
    counts = [f"{n} {s.value}" for s in Status if (n := len(report.names(s)))]
    if counts:
        lines.append("  " + ", ".join(counts))
    return "\n".join(lines)


register(
    Subcommand(
        "sync-recipes",
        "install model recipes from a directory, git repo, Hugging Face repo or tarball into "
        "the local recipe index",
        add_arguments,
        run,
    )
)
