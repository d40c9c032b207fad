"""The server's admission rules in one object: who may call (API keys), how often (the rate
limiter) and how much may wait (the queue bound). The edge middleware asks it about each HTTP
request; a route asks it again once it knows the request's tokens (`admit`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from metrale.server.errors import APIError
from metrale.server.security.api_keys import ApiKeys
from metrale.server.security.config import SecurityConfig
from metrale.server.security.rate_limiter import RateLimiter, Refusal

if TYPE_CHECKING:
    from metrale.server.security.shared_admission import WaitingSlots

# Where the edge middleware leaves the client's id for the routes (in the ASGI scope's state).
CLIENT_SCOPE_KEY = "metrale_client"
# Suggested wait before retrying when the queue is full: requests leave it as others finish.
OVERLOADED_RETRY_AFTER_S = 1
# An admitted request counts as waiting from admission until its stream starts (from then on the
# engine client counts it); one whose stream never starts (its client left first) stops counting
# after this long.
RESERVATION_TTL_S = 10.0


@dataclass
class Admission:
    """What a request took at admission: tokens charged to its client, so that what it does not
    use is refunded, and its places in the queue until its stream starts."""

    limiter: RateLimiter | None = None
    client: str = ""
    charged_output_tokens: int = 0
    reservations: dict[int, tuple[float, int]] | None = None

    def started(self) -> None:
        """The engine client counts the request from now on."""
        if self.reservations is not None:
            self.reservations.pop(id(self), None)
            self.reservations = None

    def settle(self, generated_tokens: int) -> None:
        """Refund the output tokens that were charged but not generated (once)."""
        self.started()
        if self.limiter is not None:
            self.limiter.refund_tokens(self.client, self.charged_output_tokens - generated_tokens)
            self.limiter = None


class Guard:
    def __init__(
        self,
        config: SecurityConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        limiter: RateLimiter | None = None,
        waiting: WaitingSlots | None = None,
    ):
        """`limiter` and `waiting`: the state other API processes share (`shared_admission.py`);
        this process's own by default."""
        self.config = config
        self.keys = ApiKeys(config.api_keys, require_auth=config.require_auth)
        self.limiter = limiter or RateLimiter(
            config.rate_limit_rpm, config.rate_limit_tpm, config.rate_limit_max_keys, clock
        )
        self.waiting = waiting  # the other processes' waiting requests
        self.clock = clock
        # id(admission) -> (expiry, engine requests) of admissions whose streams have not started
        self._reservations: dict[int, tuple[float, int]] = {}

    def num_reserved(self) -> int:
        now = self.clock()
        for key, (expiry, _) in list(self._reservations.items()):
            if expiry <= now:
                del self._reservations[key]
        return sum(n for _, n in self._reservations.values())

    def admit(
        self, client: str | None, prompt_tokens: int, output_tokens: int, num_waiting: int, n: int
    ) -> Admission:
        """Admit `n` engine requests of `prompt_tokens` in all and up to `output_tokens` in
        all, from `client`, while `num_waiting` wait for their first token; or raise the 429
        (529 on Anthropic's routes) that says why not."""
        limit = self.config.max_queued_requests
        if limit is not None and n > limit:  # would never fit: retrying cannot help
            raise APIError(
                f"the request asks for {n} completions but at most {limit} may wait at once "
                f"(--max-queued-requests); lower n",
                param="n",
            )
        if limit is not None:
            num_waiting += self.num_reserved()
            if self.waiting is not None:
                self.waiting.publish(num_waiting)
                num_waiting += self.waiting.others()
            if num_waiting + n > limit:
                raise overloaded_error(num_waiting, limit)
        admission = Admission()
        if client is not None and self.limiter.tokens_per_minute is not None:
            refusal = self.limiter.charge_tokens(client, prompt_tokens + output_tokens)
            if refusal is not None:
                raise rate_limit_error(refusal, self.limiter.headers(client))
            admission = Admission(self.limiter, client, output_tokens)
        if limit is not None:
            admission.reservations = self._reservations
            self._reservations[id(admission)] = (self.clock() + RESERVATION_TTL_S, n)
        return admission


def rate_limit_error(refusal: Refusal, headers: list[tuple[str, str]]) -> APIError:
    return APIError(
        refusal.message,
        429,
        code="rate_limit_exceeded",
        error_type=refusal.kind,
        headers={**dict(headers), "retry-after": str(refusal.retry_after)},
    )


def overloaded_error(num_waiting: int, limit: int) -> APIError:
    return APIError(
        f"the server is overloaded: {num_waiting} requests are waiting, the limit is {limit} "
        f"(--max-queued-requests); retry shortly",
        429,
        code="server_overloaded",
        error_type="server_overloaded",
        headers={"retry-after": str(OVERLOADED_RETRY_AFTER_S)},
        anthropic_status=529,
    )


def authentication_error() -> APIError:
    return APIError(
        "Incorrect or missing API key: send Authorization: Bearer KEY (on /v1/messages also "
        "x-api-key: KEY) with a key the server was started with",
        401,
        code="invalid_api_key",
        error_type="invalid_request_error",
        headers={"www-authenticate": "Bearer"},
    )


def body_too_large_error(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than this server accepts ({limit} bytes; --max-request-bytes)",
        413,
        code="request_too_large",
    )
