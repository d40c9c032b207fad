"""`met`: the command line. Each subcommand is a module that registers itself here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from metrale.telemetry import logs


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    aliases: tuple[str, ...] = ()


_SUBCOMMANDS: dict[str, Subcommand] = {}


def register(subcommand: Subcommand) -> None:
    _SUBCOMMANDS[subcommand.name] = subcommand


def build_parser() -> argparse.ArgumentParser:
    from metrale.entrypoints.cli import (  # noqa: F401  (they register)
        bench,
        doctor,
        generate,
        recipes,
        serve,
    )

    parser = argparse.ArgumentParser(
        prog="met",
        description="Metrale: serve and run open-weight LLMs with Metrale's own engine.",
    )
    _add_logging_arguments(parser, argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for sub in _SUBCOMMANDS.values():
        sub_parser = subparsers.add_parser(
            sub.name, help=sub.help, description=sub.help, aliases=list(sub.aliases)
        )
        sub.add_arguments(sub_parser)
        _add_logging_arguments(sub_parser, argparse.SUPPRESS)
        sub_parser.set_defaults(run=sub.run)
    return parser


def _add_logging_arguments(parser: argparse.ArgumentParser, default: object) -> None:
    """Logging flags, taken before or after the subcommand (`met serve --log-format json`)."""
    g = parser.add_argument_group("logging")
    g.add_argument(
        "--log-level",
        default=default,
        choices=["debug", "info", "warning", "error"],
        help="logging verbosity (default: info)",
    )
    g.add_argument(
        "--log-format",
        default=default,
        choices=list(logs.FORMATS),
        help="log lines as text, or one JSON object per line for log collectors (default: text)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"met {args.command}: error: {e}", file=sys.stderr)
        return 2
