"""KV cache blocks on the host side: who holds each block, and which prefixes they cache.

A block holds `block_size` consecutive positions of one sequence. Sequences hold blocks
by reference count, so sequences with a common prefix share its blocks. A full block is
named by a hash chain over its tokens, its parent block's hash and the K/V key (the
adapter's content identity, or the base model's): the same hash means the same K/V,
whoever computed them. Blocks no sequence holds stay in the free queue with their hash, so
a later prompt with that prefix finds them, until they are handed out again: the free
queue hands out blocks holding nothing first, then cached ones least recently freed
first (a finished sequence frees its blocks last to first, so its prefix outlives its
tail). Block 0 is the null block and is never handed out.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from lora_runtime.model.kv_cache import NULL_BLOCK

BlockHash = bytes


def block_hashes(tokens: Sequence[int], block_size: int, key: bytes, *, start: int = 0,
                 parent: BlockHash | None = None, count: int | None = None) -> list[BlockHash]:
    """The hash chain of the full blocks of `tokens` from block `start` (whose predecessor's hash
    is `parent`; None at block 0), `count` blocks or as many as are full."""
    full = len(tokens) // block_size
    stop = full if count is None else min(full, start + count)
    if parent is None:
        if start != 0:
            raise ValueError(f"block {start=} needs its parent's hash")
        parent = hashlib.blake2b(b"kv:" + key, digest_size=16).digest()
    hashes = []
    data = np.asarray(tokens[start * block_size:stop * block_size], np.int64).tobytes()
    width = 8 * block_size
    for i in range(stop - start):
        parent = hashlib.blake2b(parent + data[i * width:(i + 1) * width], digest_size=16).digest()
        hashes.append(parent)
    return hashes


class OutOfBlocks(Exception):
    """No free block is left (the scheduler preempts or waits)."""


class BlockPool:
    """Reference counts, cached prefixes and the free queue of `num_blocks` blocks (block 0 excluded)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=} must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        # Free blocks in hand-out order; OrderedDict: O(1) removal when a cached one is reused.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (b, None) for b in range(num_blocks) if b != NULL_BLOCK)

    @property
    def usable(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (some may cache a prefix until handed out)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a hashed (shareable) prefix block, held or free."""
        return len(self._cached)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for one sequence (refcount 1), their old cached contents forgotten."""
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks asked, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            old = self._hash[block]
            if old is not None:
                del self._cached[old]
                self._hash[block] = None
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks caching the longest run of `hashes` from the first (nothing is taken)."""
        hits = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def take(self, blocks: Iterable[int]) -> None:
        """One more reference to each block (cached blocks found by lookup)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def release(self, blocks: Sequence[int], *, forget: bool = False) -> None:
        """Drops one reference to each block, last first; a block nobody holds becomes free,
        keeping its cached prefix unless `forget` (its contents are not to be trusted)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"block {block} released more often than held")
            if forget:
                self._forget(block)
            if self._refs[block] == 0:
                self._free[block] = None
                if self._hash[block] is None:  # holds nothing worth keeping: hand it out first
                    self._free.move_to_end(block, last=False)

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Records that a held `block` now caches the full block named `block_hash` (kept only
        if no other block caches it already)."""
        if block_hash not in self._cached and self._hash[block] is None:
            self._cached[block_hash] = block
            self._hash[block] = block_hash

    def forget_all(self) -> None:
        """Every cached prefix is dropped (the cache's contents were lost)."""
        for block in list(self._cached.values()):
            self._forget(block)

    def _forget(self, block: int) -> None:
        old = self._hash[block]
        if old is not None:
            del self._cached[old]
            self._hash[block] = None
