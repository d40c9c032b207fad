"""API keys: which requests must carry one, where it is read from, and the constant-time check.

A presented key is hashed once and its digest compared with every configured key's digest with
`hmac.compare_digest`, with no early exit, so neither the time taken nor the digests' equal
lengths say how much of a key was right, or which key it was near. Keys are held as digests
only and never logged; a client is known to the rate limiter by its key's digest.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

# Always open: load balancers and orchestrators probe these without credentials.
OPEN_PATHS = frozenset({"/health", "/health/live"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str] = (), *, require_auth: bool = False) -> None:
        self._digests = [_digest(key) for key in dict.fromkeys(keys)]
        self.require_auth = require_auth

    def guards(self, path: str) -> bool:
        """Whether a request for `path` must carry a key: every `/v1` route once a key is set,
        and with `--require-auth` every route but the health probes."""
        if not self._digests or path in OPEN_PATHS:
            return False
        return self.require_auth or path == "/v1" or path.startswith("/v1/")

    def identify(self, presented: str | None) -> str | None:
        """The client id (a digest of the key) if `presented` is a configured key, else None."""
        if presented is None:
            return None
        candidate = _digest(presented)
        match = -1
        for i, digest in enumerate(self._digests):
            if hmac.compare_digest(candidate, digest):
                match = i
        return None if match < 0 else "key:" + candidate.hex()[:32]


def presented_keys(headers: dict[bytes, bytes], anthropic: bool) -> list[str]:
    """The keys a request carries: `Authorization: Bearer KEY`, and on the Anthropic routes
    also `x-api-key: KEY` (what the Anthropic SDKs send)."""
    keys = []
    authorization = headers.get(b"authorization")
    if authorization is not None:
        scheme, _, value = authorization.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            keys.append(value.strip())
    if anthropic and (value := headers.get(b"x-api-key", b"").decode("latin-1").strip()):
        keys.append(value)
    return keys
