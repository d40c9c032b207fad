"""Per-client token buckets for requests and tokens per minute (the seed's `rate_limiter.rs`).

A bucket holds one minute's allowance (burst = the per-minute limit) and refills continuously at
limit / 60 a second. Requests are charged one at a time when they arrive; tokens are charged at
admission (the prompt plus `max_tokens`) and what was not generated is refunded when the request
ends. The table of clients is bounded: past `max_keys`, the least recently used bucket is
forgotten (a forgotten client starts again with a full bucket), so a flood of new clients cannot
grow memory.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

SECONDS_PER_MINUTE = 60.0


class TokenBucket:
    """`capacity` units that refill at `capacity` a minute."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.updated = now

    @property
    def rate(self) -> float:
        """Units refilled per second."""
        return self.capacity / SECONDS_PER_MINUTE

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = max(self.updated, now)

    def seconds_until(self, amount: int, now: float) -> float:
        """How long until `amount` fits (0 if it fits now; inf if it never can)."""
        self.refill(now)
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: int, now: float) -> float:
        """Take `amount` if it fits and return 0, else take nothing and return the wait."""
        wait = self.seconds_until(amount, now)
        if wait == 0:
            self.level -= amount
        return wait

    def give_back(self, amount: int, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)

    def remaining(self, now: float) -> int:
        self.refill(now)
        return max(0, math.floor(self.level))

    def seconds_to_full(self, now: float) -> float:
        self.refill(now)
        return (self.capacity - self.level) / self.rate


@dataclass
class ClientBuckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


@dataclass(frozen=True)
class Refusal:
    """Why a client is over its limit: `kind` is "requests" or "tokens"."""

    kind: str
    limit: int
    retry_after_s: float
    requested: int = 1

    @property
    def retry_after(self) -> int:
        """Whole seconds, rounded up, at least 1 (the `Retry-After` header)."""
        if math.isinf(self.retry_after_s):
            return int(SECONDS_PER_MINUTE)
        return max(1, math.ceil(self.retry_after_s))

    @property
    def message(self) -> str:
        if self.kind == "requests":
            return (
                f"Rate limit reached for requests: limit {self.limit} per minute. "
                f"Please try again in {self.retry_after}s."
            )
        if math.isinf(self.retry_after_s):
            return (
                f"Request too large for the tokens-per-minute limit: limit {self.limit}, "
                f"requested {self.requested} (prompt plus max_tokens); lower max_tokens or "
                f"shorten the prompt."
            )
        return (
            f"Rate limit reached for tokens: limit {self.limit} per minute, requested "
            f"{self.requested} (prompt plus max_tokens). Please try again in {self.retry_after}s."
        )


@dataclass
class RateLimiter:
    """Buckets per client id, created on first use; `None` limits are not enforced."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_keys: int = 10_000
    clock: Callable[[], float] = time.monotonic
    _clients: OrderedDict[str, ClientBuckets] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (got {value})")
        if self.max_keys < 1:
            raise ValueError(f"max_keys must be at least 1 (got {self.max_keys})")

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    def _new_buckets(self, now: float) -> ClientBuckets:
        rpm, tpm = self.requests_per_minute, self.tokens_per_minute
        return ClientBuckets(
            TokenBucket(rpm, now) if rpm is not None else None,
            TokenBucket(tpm, now) if tpm is not None else None,
        )

    @contextlib.contextmanager
    def _use(self, client: str, now: float, create: bool = True) -> Iterator[ClientBuckets | None]:
        """`client`'s buckets, to read or change: made on first use and then the most recently
        used (`create`), or as they are, None if there are none."""
        if not create:
            yield self._clients.get(client)
            return
        buckets = self._clients.get(client)
        if buckets is None:
            buckets = self._clients[client] = self._new_buckets(now)
            while len(self._clients) > self.max_keys:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        yield buckets

    def charge_request(self, client: str) -> Refusal | None:
        """Count one request against `client`'s requests per minute."""
        if self.requests_per_minute is None:
            return None
        now = self.clock()
        with self._use(client, now) as buckets:
            assert buckets is not None and buckets.requests is not None
            wait = buckets.requests.take(1, now)
        return None if wait == 0 else Refusal("requests", self.requests_per_minute, wait)

    def charge_tokens(self, client: str, amount: int) -> Refusal | None:
        """Charge `amount` tokens at admission; refund what goes unused with `refund_tokens`."""
        if self.tokens_per_minute is None:
            return None
        now = self.clock()
        with self._use(client, now) as buckets:
            assert buckets is not None and buckets.tokens is not None
            wait = buckets.tokens.take(amount, now)
        return None if wait == 0 else Refusal("tokens", self.tokens_per_minute, wait, amount)

    def refund_tokens(self, client: str, amount: int) -> None:
        if amount <= 0 or self.tokens_per_minute is None:
            return
        now = self.clock()
        with self._use(client, now, create=False) as buckets:
            if buckets is not None and buckets.tokens is not None:
                buckets.tokens.give_back(amount, now)

    def headers(self, client: str) -> list[tuple[str, str]]:
        """OpenAI's `x-ratelimit-*` headers for `client`, for the limits that are set."""
        if not self.enabled:
            return []
        now = self.clock()
        out = []
        with self._use(client, now, create=False) as buckets:
            if buckets is None:
                return []
            for kind, bucket in (("requests", buckets.requests), ("tokens", buckets.tokens)):
                if bucket is None:
                    continue
                out += [
                    (f"x-ratelimit-limit-{kind}", str(bucket.capacity)),
                    (f"x-ratelimit-remaining-{kind}", str(bucket.remaining(now))),
                    (f"x-ratelimit-reset-{kind}", format_duration(bucket.seconds_to_full(now))),
                ]
        return out


def format_duration(seconds: float) -> str:
    """A duration as OpenAI writes its reset headers: `1s`, `6m0s`, `20ms`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
