"""The pool of KV-cache blocks, with prefix caching.

A block holds the keys and values of `block_size` consecutive tokens of one sequence, for every
layer. The pool owns every block and what stays true of each:
- `ref_count` is the number of running requests whose block table holds it;
- a block with `ref_count == 0` is free: with no cached contents, in the clean set; with them,
  in the evictable queue, least recently freed first;
- a full block may carry the chained hash of its tokens (and of every token before them); the
  hash maps back to the block in `cached`, and stays valid while the block sits in the evictable
  queue, so a later request with the same prefix reuses it. Taking such a block for new tokens
  evicts its hash.

New tokens take clean blocks first, the lowest-numbered first, and evict cached contents only
when no clean block is left (as SGLang's radix cache takes its free pool before it evicts), so
no cached prefix is lost while room that holds nothing is free. (The order of a request's
blocks in the pool made no measurable difference to a step on an H100 or on a CPU:
bench/results/block_order-2026-12-06.txt.)
"""

from __future__ import annotations

import array
import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: it names the block's tokens and the whole prefix before.

    SHA-256 rather than Python's `hash`: a server must not let one client craft a collision that
    hands it another client's cached keys and values.
    """
    return hashlib.sha256(parent + array.array("q", token_ids).tobytes()).digest()


def hash_blocks(parent: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """`hash_block` chained over each full block of `token_ids`, after `parent`. The tokens
    become bytes in one conversion, not one per block: half the time of a 2k-token prompt."""
    data = array.array("q", token_ids).tobytes()
    step = block_size * 8  # int64 tokens
    hashes = []
    for start in range(0, len(token_ids) // block_size * step, step):
        parent = hashlib.sha256(parent + data[start : start + step]).digest()
        hashes.append(parent)
    return hashes


def root_hash(cache_salt: str | None = None) -> BlockHash:
    """The parent of a sequence's first block; a salt keeps tenants' caches apart."""
    return hashlib.sha256((cache_salt or "").encode()).digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._clean: list[int] = list(range(num_blocks))  # a heap of free, uncached block ids
        self._evictable: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks: clean ones, lowest first, then by evicting the least
        recently freed cached contents."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks with {self.num_free_blocks} free")
        clean = min(num_blocks, len(self._clean))
        taken = [self.blocks[heapq.heappop(self._clean)] for _ in range(clean)]
        for _ in range(num_blocks - clean):
            _, block = self._evictable.popitem(last=False)
            del self.cached[block.block_hash]
            block.block_hash = None
            taken.append(block)
        for block in taken:
            block.ref_count = 1
        return taken

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Claim cached blocks for one more request."""
        for block in blocks:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one request's claim; pass blocks tail first so prefixes are evicted last."""
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} released twice"
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                heapq.heappush(self._clean, block.block_id)
            else:
                self._evictable[block.block_id] = block

    def cache(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its hash; an identical block published first stays."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
