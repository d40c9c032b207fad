"""Which blocks each request holds, and how many of its tokens the prefix cache already has.

The scheduler asks before it acts: `find_cached_prefix` says what a waiting request can reuse,
`allocate` either claims every block a step needs or claims nothing and returns False (the
scheduler then preempts or waits). `free` gives a finished or preempted request's blocks back;
their full blocks stay hashed in the pool for the next request with the same prefix.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

from metrale.engine.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_blocks, root_hash
from metrale.engine.request import Request

_NO_BLOCKS = array.array("q")


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks' ids, kept alongside as int64 arrays: a step copies each request's
        # block table into the runner's buffer with one memcpy, and builds no list.
        self._block_ids: dict[str, array.array] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_published: dict[str, int] = {}

    def block_ids(self, request_id: str) -> array.array:
        """The request's block table; the live array, valid until its next allocate or free."""
        return self._block_ids.get(request_id, _NO_BLOCKS)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that starts the request's tokens.

        At least one token is always left to compute: the step that computes it yields the
        logits the next token is sampled from.
        """
        if not self.pool.enable_prefix_caching:
            return []
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_admission(self, request: Request, num_cached_tokens: int) -> None:
        """Count a first admission's prompt in the prefix-cache stats (retries do not count)."""
        if request.num_preemptions == 0:
            self.stats.num_queried_tokens += request.num_prompt_tokens
            self.stats.num_hit_tokens += num_cached_tokens

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached_prefix: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Claim blocks for `num_new_tokens` more tokens (after an optional cached prefix)."""
        held = self._blocks.get(request.request_id)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if held and cached_prefix is None and num_tokens <= len(held) * self.block_size:
            # Most decodes: the tokens fit the blocks held; blocks they fill may become cached.
            if num_tokens // self.block_size > self._num_published.get(request.request_id, 0):
                self._publish_full_blocks(request, held, num_tokens)
            return True
        held = self._blocks.setdefault(request.request_id, [])
        cached_prefix = cached_prefix or []
        num_computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        num_needed = self.num_blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_needed - len(held) - len(cached_prefix)
        # Cached blocks nobody holds sit in the free queue: claiming them uses up free blocks too.
        num_revived = sum(1 for b in cached_prefix if b.ref_count == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            if not held:
                del self._blocks[request.request_id]
            return False
        self.pool.touch(cached_prefix)
        new_blocks = cached_prefix + (
            self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        )
        held.extend(new_blocks)
        ids = self._block_ids.setdefault(request.request_id, array.array("q"))
        ids.extend(b.block_id for b in new_blocks)
        self._publish_full_blocks(request, held, num_computed + num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self.pool.release(blocks[::-1])
        self._num_published.pop(request.request_id, None)
        if request.is_finished:
            self._hashes.pop(request.request_id, None)

    def _publish_full_blocks(
        self, request: Request, held: list[KVCacheBlock], num_tokens: int
    ) -> None:
        if not self.pool.enable_prefix_caching:
            return
        hashes = self._block_hashes(request)
        first = self._num_published.get(request.request_id, 0)
        last = min(num_tokens // self.block_size, len(hashes))
        for i in range(first, last):
            self.pool.cache(held[i], hashes[i])
        self._num_published[request.request_id] = max(first, last)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        start, end = len(hashes) * bs, len(tokens) // bs * bs
        if end > start:
            parent = hashes[-1] if hashes else root_hash()
            hashes.extend(hash_blocks(parent, tokens[start:end], bs))
        return hashes
