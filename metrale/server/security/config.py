"""The flags of the server's edge: API keys, rate limits, the queue bound, the body-size limit."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from metrale import envs
from metrale.engine_args import parse_bytes

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20


@dataclass(frozen=True)
class SecurityConfig:
    api_keys: tuple[str, ...] = ()
    require_auth: bool = False
    rate_limit_rpm: int | None = None
    rate_limit_tpm: int | None = None
    rate_limit_max_keys: int = 10_000
    max_queued_requests: int | None = None  # None: unbounded
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if any(not key.strip() for key in self.api_keys):
            raise ValueError("--api-key: a key cannot be empty")
        if self.require_auth and not self.api_keys:
            raise ValueError(
                "--require-auth needs at least one API key (--api-key KEY or METRALE_API_KEY)"
            )
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests {self.max_queued_requests}: at least 1")
        if self.max_request_bytes < 1:
            raise ValueError("--max-request-bytes must be at least 1 byte")

    def __repr__(self) -> str:  # keys never reach a log, /serve-config or a traceback
        fields = {**self.__dict__, "api_keys": f"<{len(self.api_keys)} keys>"}
        return "SecurityConfig(" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")"

    def describe(self) -> dict[str, object]:
        """What /serve-config reports: how many keys, never the keys."""
        return {**self.__dict__, "api_keys": len(self.api_keys)}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("security and limits")
        g.add_argument(
            "--api-key",
            action="append",
            default=[],
            metavar="KEY",
            help="a key every /v1 request must carry (Authorization: Bearer KEY, or x-api-key "
            "on /v1/messages); repeat for several; also METRALE_API_KEY (comma-separated)",
        )
        g.add_argument(
            "--require-auth",
            action="store_true",
            help="also require a key on /tokenize, /detokenize and the operator routes "
            "(/serve-config, /hardware, /memory); refuse to start without one. /health and "
            "/health/live stay open",
        )
        g.add_argument(
            "--max-queued-requests",
            type=int,
            metavar="N",
            help="answer 429 (Anthropic: 529 overloaded_error) with Retry-After once N requests "
            "wait for their first token (default: no bound)",
        )
        g.add_argument(
            "--max-request-bytes",
            type=parse_bytes,
            default=DEFAULT_MAX_REQUEST_BYTES,
            metavar="SIZE",
            help="largest request body, e.g. 32MiB (the default); larger ones get 413",
        )

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> SecurityConfig:
        """The flags, with METRALE_API_KEY and the METRALE_RATE_LIMIT_* variables."""
        return cls(
            api_keys=tuple(dict.fromkeys([*args.api_key, *envs.api_keys()])),
            require_auth=args.require_auth,
            rate_limit_rpm=envs.rate_limit_rpm(),
            rate_limit_tpm=envs.rate_limit_tpm(),
            rate_limit_max_keys=envs.rate_limit_max_keys(),
            max_queued_requests=args.max_queued_requests,
            max_request_bytes=args.max_request_bytes,
        )
