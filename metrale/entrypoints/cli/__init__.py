"""`met`: the command line. Each subcommand is a module that registers itself here."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


_SUBCOMMANDS: dict[str, Subcommand] = {}


def register(subcommand: Subcommand) -> None:
    _SUBCOMMANDS[subcommand.name] = subcommand


def build_parser() -> argparse.ArgumentParser:
    from metrale.entrypoints.cli import generate, serve  # noqa: F401  (they register)

    parser = argparse.ArgumentParser(
        prog="met",
        description="Metrale: serve and run open-weight LLMs with Metrale's own engine.",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging verbosity",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for sub in _SUBCOMMANDS.values():
        sub_parser = subparsers.add_parser(sub.name, help=sub.help, description=sub.help)
        sub.add_arguments(sub_parser)
        sub_parser.set_defaults(run=sub.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"met {args.command}: error: {e}", file=sys.stderr)
        return 2
