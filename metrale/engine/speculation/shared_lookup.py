"""A bounded n-gram table across requests: what followed each n-gram in requests that finished.

Agents send again what they saw before (files, tool results, earlier replies), often in a later
request. When a request's own tokens have no earlier match for their end, its draft can come from
here: the tokens that followed the same n-gram (`ngram_max` long) in a finished request.

Entries live in namespaces: the model (a fingerprint of its name and path), the tokenizer (of
its `tokenizer.json` bytes), and the tenant (the API key's client; None without keys), so one
tenant's text never becomes a draft for another's request, and a table is never read with
another model's or tokenizer's ids. At most `max_entries` entries in all, least recently used
evicted first; an entry holds the n-gram and up to `num_speculative_tokens` ids (about 0.35 KB
with its bookkeeping: 262,144 entries, the default, take about 90 MB).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path


def fingerprint(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:16]


def model_fingerprints(model_name: str, model_dir: Path) -> tuple[str, str]:
    """(the model's fingerprint, the tokenizer's): the shared table's namespace."""
    tokenizer_file = model_dir / "tokenizer.json"
    tokenizer_bytes = tokenizer_file.read_bytes() if tokenizer_file.is_file() else b""
    return fingerprint(model_name, str(model_dir)), fingerprint(tokenizer_bytes)


class SharedLookup:
    """What followed each n-gram, per namespace, least recently used evicted first."""

    def __init__(
        self, ngram_len: int, continuation_len: int, max_entries: int, fingerprints: tuple[str, str]
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: the shared lookup needs room for one")
        self.ngram_len = ngram_len
        self.continuation_len = continuation_len
        self.max_entries = max_entries
        self.fingerprints = fingerprints
        self._namespaces: dict[str | None, tuple[str, str, str | None]] = {}
        self._entries: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        self.num_fed_requests = 0
        self.num_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def feed(self, tenant: str | None, token_ids: Sequence[int]) -> None:
        """Learn a finished request's tokens: each n-gram, and the tokens after it."""
        namespace = self._namespace(tenant)
        n, k = self.ngram_len, self.continuation_len
        entries = self._entries
        for start in range(len(token_ids) - n):
            key = (namespace, tuple(token_ids[start : start + n]))
            entries[key] = tuple(token_ids[start + n : start + n + k])
            entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        self.num_fed_requests += 1

    def lookup(self, tenant: str | None, token_ids: Sequence[int]) -> list[int]:
        """The tokens that followed the last `ngram_len` of `token_ids` (none when unknown)."""
        if len(token_ids) < self.ngram_len:
            return []
        key = (self._namespace(tenant), tuple(token_ids[len(token_ids) - self.ngram_len :]))
        found = self._entries.get(key)
        if found is None:
            return []
        self._entries.move_to_end(key)
        self.num_hits += 1
        return list(found)

    def _namespace(self, tenant: str | None) -> tuple[str, str, str | None]:
        namespace = self._namespaces.get(tenant)
        if namespace is None:  # one tuple per tenant, shared by its entries
            namespace = self._namespaces[tenant] = (*self.fingerprints, tenant)
        return namespace
