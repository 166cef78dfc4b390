"""BlockManager on the real class: allocation, reference counts, prefix hits, LRU eviction."""
import pytest

from atom.model_engine.block_manager import BlockManager, chain_hash
from atom.model_engine.sequence import Sequence


def seq(tokens):
    return Sequence(list(tokens))


def run_all(bm, s):
    """Allocate and 'compute' every token of s, then publish its full blocks."""
    bm.append_slots(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.publish_full_blocks(s)


def test_allocate_and_free_counts():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.can_append(s, 10)
    bm.append_slots(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.slot(s, 5) == s.block_table[1] * 4 + 1
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_out_of_blocks():
    bm = BlockManager(2, 4)
    s = seq(range(9))
    assert not bm.can_append(s, 9)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.append_slots(s, 9)


def test_invalid_sizes():
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(0, 16)


def test_prefix_hit_shares_blocks_and_counts():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = seq(range(13))                # 3 full blocks + 1 token
    run_all(bm, a)
    b = seq(list(range(12)) + [99, 98])  # same first 3 blocks
    cached = bm.allocate_prefix(b)
    assert cached == 12 and b.num_computed_tokens == 12
    assert b.block_table == a.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in b.block_table)
    assert bm.num_hit_tokens == 12 and bm.num_query_tokens == 12
    assert bm.hit_rate == 1.0


def test_full_prompt_never_served_wholly_from_cache():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = seq(range(8))
    run_all(bm, a)
    b = seq(range(8))                 # identical 2-block prompt
    assert bm.allocate_prefix(b) == 4  # the last block is recomputed: logits are needed
    assert b.num_uncomputed_tokens == 4


def test_hash_is_chained():
    h1 = chain_hash(-1, [1, 2])
    assert chain_hash(h1, [3, 4]) != chain_hash(chain_hash(-1, [9, 9]), [3, 4])
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5])
    run_all(bm, a)
    b = seq([9, 9, 3, 4, 5])          # second block equal, first differs: no hit
    assert bm.allocate_prefix(b) == 0


def test_freed_cached_blocks_hit_until_reused_lru():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5])
    run_all(bm, a)                     # 3 blocks, 2 full published
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq([1, 2, 3, 4, 7])
    assert bm.allocate_prefix(b) == 4  # hit on freed-but-cached blocks
    bm.free(b)
    # fill the cache with other content: the cached blocks get evicted (LRU order)
    c = seq([50, 51, 52, 53, 54, 55, 56, 57])
    bm.append_slots(c, 8)
    assert bm.num_free_blocks == 0 and not bm.hash_to_block
    bm.free(c)
    d = seq([1, 2, 3, 4, 7])
    assert bm.allocate_prefix(d) == 0


def test_unhashed_blocks_reused_before_cached_ones():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = seq([1, 2, 3])
    run_all(bm, a)                     # block0 full+published, block1 partial
    bm.free(a)
    s = seq([8])
    bm.append_slots(s, 1)
    assert bm.blocks[s.block_table[0]].hash is None  # took a block without cached content
    assert len(bm.hash_to_block) == 1                 # the published block survived


def test_no_prefix_caching_means_no_hits():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = seq(range(9))
    run_all(bm, a)
    b = seq(range(9))
    assert bm.allocate_prefix(b) == 0 and bm.num_query_tokens == 0
    assert "prefix_caching=False" in repr(bm)


def test_trim_returns_blocks_past_the_end():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = seq(range(8))
    run_all(bm, a)                     # 2 full blocks, published
    b = seq(range(8))
    bm.allocate_prefix(b)              # shares block 0
    bm.append_slots(b, 7)              # 4 + 7 = 11 tokens: blocks 0 (shared), +2 new
    tail = b.block_table[2]
    assert bm.trim(b, 6) == 1          # 6 tokens need 2 blocks: the third goes back, first in line
    assert len(b.block_table) == 2 and next(iter(bm.free_blocks)) == tail
    assert bm.trim(b, 6) == 0
    assert bm.trim(b, 3) == 1          # the shared block stays, still referenced by a
    assert b.block_table == a.block_table[:1] and bm.blocks[a.block_table[0]].ref_count == 2
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 8
