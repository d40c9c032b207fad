import pytest

from metrale.engine.block_pool import BlockPool, hash_block, hash_blocks, root_hash


def test_allocate_and_release_round_trip():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    pool.release(blocks[::-1])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="asked for 5 blocks with 4 free"):
        pool.allocate(5)


def test_cached_block_survives_release_until_evicted():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block(root_hash(), [1, 2, 3])
    pool.cache(block, h)
    pool.release([block])
    assert pool.lookup(h) is block, "a freed block keeps its contents until reused"
    pool.allocate(1)  # the block that holds nothing is taken first
    assert pool.lookup(h) is block
    pool.allocate(1)  # now the cached block is the only one left: taking it evicts the hash
    assert pool.lookup(h) is None
    assert block.block_hash is None


def test_blocks_that_hold_nothing_are_taken_before_any_cached_contents_are_evicted():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks[:2]):
        pool.cache(block, hash_block(root_hash(), [i]))
    pool.release(blocks[:2][::-1])  # cached contents, freed first
    pool.release(blocks[2:][::-1])  # nothing cached, freed after them
    assert {b.block_id for b in pool.allocate(2)} == {2, 3}
    assert pool.num_cached_blocks == 2
    taken = pool.allocate(2)  # now only by evicting: least recently freed first
    assert pool.num_cached_blocks == 0
    assert [b.block_id for b in taken] == [1, 0], "released tail first, so evicted tail first"


def test_new_blocks_come_lowest_first_whatever_order_they_were_freed_in():
    pool = BlockPool(8, enable_prefix_caching=False)
    blocks = pool.allocate(8)
    assert [b.block_id for b in blocks] == list(range(8))
    pool.release([blocks[i] for i in (5, 1, 7, 3)])
    assert [b.block_id for b in pool.allocate(2)] == [1, 3]
    pool.release([blocks[i] for i in (6, 0)])
    assert [b.block_id for b in pool.allocate(4)] == [0, 5, 6, 7]
    assert pool.num_free_blocks == 0


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    pool.release([block])
    assert pool.num_free_blocks == 2
    pool.touch([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 1


def test_release_twice_is_caught():
    pool = BlockPool(1)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(AssertionError, match="released twice"):
        pool.release(blocks)


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_block(root_hash(), [1, 2])
    b = hash_block(root_hash(), [1, 3])
    assert hash_block(a, [5, 6]) != hash_block(b, [5, 6])
    assert hash_block(a, [5, 6]) == hash_block(hash_block(root_hash(), [1, 2]), [5, 6])
    assert root_hash("tenant-a") != root_hash("tenant-b")


def test_prefix_caching_off_publishes_nothing():
    pool = BlockPool(2, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    assert pool.lookup(b"h") is None


def test_hash_blocks_chains_hash_block_over_the_full_blocks():
    tokens = list(range(100, 111))  # two full blocks of 4 and 3 tokens left over
    first = hash_block(root_hash(), tokens[:4])
    assert hash_blocks(root_hash(), tokens, 4) == [first, hash_block(first, tokens[4:8])]
    assert hash_blocks(first, tokens[4:8], 4) == [hash_block(first, tokens[4:8])]
    assert hash_blocks(root_hash(), tokens[:3], 4) == []
