"""The block pool: hand-out order, reference counts, hash chains, cached prefixes and eviction."""

from __future__ import annotations

import pytest

from lora_runtime.engine.block_pool import BlockPool, OutOfBlocks, block_hashes


def test_hash_chain_depends_on_tokens_parent_and_key():
    a = block_hashes(list(range(12)), 4, b"")
    assert len(a) == 3 and len(set(a)) == 3
    assert block_hashes(list(range(13)), 4, b"") == a  # a partial block has no hash
    assert block_hashes(list(range(12)), 4, b"adapter") != a  # another adapter: other K/V
    b = block_hashes([99] + list(range(1, 12)), 4, b"")
    assert b[0] != a[0] and b[1] != a[1]  # equal tokens after a different parent differ too
    rest = block_hashes(list(range(12)), 4, b"", start=1, parent=a[0])
    assert rest == a[1:]
    with pytest.raises(ValueError, match="needs its parent"):
        block_hashes(list(range(12)), 4, b"", start=1)


def test_allocate_and_release_keep_exact_accounting():
    pool = BlockPool(6, 4)
    assert pool.usable == pool.num_free == 5
    blocks = pool.allocate(3)
    assert 0 not in blocks and pool.num_free == 2  # block 0 is the null block
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    pool.release(blocks)
    assert pool.num_free == 5 and all(pool.refcount(b) == 0 for b in blocks)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(blocks[:1])


def test_cached_blocks_are_found_shared_and_evicted_last_first():
    pool = BlockPool(8, 4)
    hashes = block_hashes(list(range(12)), 4, b"")
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    assert pool.lookup(hashes) == blocks and pool.num_cached == 3
    pool.take(pool.lookup(hashes[:2]))  # a second sequence shares the first two
    assert [pool.refcount(b) for b in blocks] == [2, 2, 1]
    pool.release(blocks)  # the first finishes: its blocks stay cached
    assert pool.num_free == 5 and pool.lookup(hashes) == blocks
    # Blocks holding nothing go first; then cached ones, the finished sequence's tail first.
    fresh = pool.allocate(4)
    assert not set(fresh) & set(blocks)
    fresh += pool.allocate(1)
    assert set(fresh) & set(blocks) == {blocks[2]}
    assert pool.lookup(hashes) == blocks[:2]  # its tail was handed out: the chain stops there
    pool.release(blocks[:2])
    pool.release(fresh)
    assert pool.num_free == pool.usable


def test_a_hash_is_cached_once_and_forgotten_with_bad_contents():
    pool = BlockPool(5, 2)
    h = block_hashes([1, 2], 2, b"")[0]
    first, second = pool.allocate(2)
    pool.register(first, h)
    pool.register(second, h)  # the same content computed twice: the first keeps the name
    assert pool.lookup([h]) == [first]
    pool.release([first], forget=True)
    assert pool.lookup([h]) == [] and pool.num_cached == 0
    pool.register(second, h)
    pool.forget_all()
    assert pool.lookup([h]) == []
