"""`BlockManager`: the paged KV cache's bookkeeping (no tensors live here).

The cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a
block table (list of block ids); token `i` of it lives in slot
`block_table[i // block_size] * block_size + i % block_size`.

Prefix caching (optional): once a block is full and its K/V computed, it is published
under a hash chained over the previous block's hash and its own token ids, so equal
prefixes hash equally. A new sequence takes matching published blocks (reference count
+1) instead of recomputing them -- but never its whole prompt, so that the last prompt
token is always run and yields logits to sample from. A block whose count drops to 0 goes
to the free list *with* its hash: it can still be hit until it is reused, least recently
freed first (LRU).

Multi-token steps take slots for draft tokens the model may reject; `trim` hands the
blocks wholly past the confirmed end back. Only blocks whose every token is computed and
confirmed are ever published, so a block holding a rejected draft never is.

`fork` shares a sequence's full, computed blocks with another sequence of the same tokens
(the n completions of one prompt): the child takes a reference on each (no copy, no
recompute) whether or not prefix caching is on; a block is free once every holder let go.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

from atom.model_engine.sequence import Sequence

logger = logging.getLogger(__name__)


def chain_hash(prev_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """Hash of one full block, chained on the previous block's hash (-1 for the first)."""
    return hash((prev_hash, tuple(token_ids)))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in LRU order: the first is reused first
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # prefix-cache counters, in tokens of full blocks looked up / found
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # --- inspection --------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def __repr__(self) -> str:
        return (f"BlockManager(blocks={self.num_blocks}x{self.block_size}, used={self.num_used_blocks}, "
                f"prefix_caching={self.enable_prefix_caching}, cached_hashes={len(self.hash_to_block)}, "
                f"hit_rate={self.hit_rate:.2%})")

    # --- low level -----------------------------------------------------------------
    def _take_free(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its published contents
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def _seq_block_hash(self, seq: Sequence, i: int) -> int:
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            prev = seq.block_hashes[j - 1] if j else -1
            seq.block_hashes.append(chain_hash(prev, seq.block_tokens(j, self.block_size)))
        return seq.block_hashes[i]

    def cacheable_tokens(self, num_tokens: int) -> int:
        """Tokens of a prompt that prefix caching may serve: its full blocks before the last
        token (which must be computed to have logits). 0 with prefix caching off."""
        if not self.enable_prefix_caching:
            return 0
        return (num_tokens - 1) // self.block_size * self.block_size

    # --- the sequence-level API ----------------------------------------------------
    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks its prefix-cache hits; returns the cached tokens."""
        assert not seq.block_table, f"{seq} already has blocks"
        if not self.enable_prefix_caching:
            return 0
        lookup = self.cacheable_tokens(seq.num_tokens)
        self.num_query_tokens += lookup
        for i in range(lookup // self.block_size):
            h = self._seq_block_hash(seq, i)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(seq.block_tokens(i, self.block_size)):
                break  # hash collision: not the same tokens
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        cached = len(seq.block_table) * self.block_size
        self.num_hit_tokens += cached
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        return cached

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> int:
        """Give `child` (no blocks yet, the same first tokens as `parent`) references on the
        parent's blocks that hold its first `num_tokens` tokens, whole and computed blocks
        only; the child's K/V for those tokens are then computed. Returns the shared tokens."""
        assert not child.block_table, f"{child} already has blocks"
        bs = self.block_size
        k = min(num_tokens, parent.num_computed_tokens) // bs
        assert child.token_ids[:k * bs] == parent.token_ids[:k * bs], "fork of different tokens"
        for block_id in parent.block_table[:k]:
            self.blocks[block_id].ref_count += 1
        child.block_table = parent.block_table[:k]
        child.block_hashes = parent.block_hashes[:k]
        child.num_computed_tokens = k * bs
        return k * bs

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make the block table cover `num_computed_tokens + num_new_tokens` tokens."""
        need = self._blocks_needed(seq, num_new_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self.free_blocks)} free")
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def publish_full_blocks(self, seq: Sequence) -> None:
        """After a step: publish the hashes of blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_published_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = self._seq_block_hash(seq, i)
                block.token_ids = tuple(seq.block_tokens(i, self.block_size))
                self.hash_to_block.setdefault(block.hash, block.block_id)
        seq.num_published_blocks = max(seq.num_published_blocks, num_full)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"double free of {block}"
        if block.ref_count == 0:
            if block.hash is None or not self.enable_prefix_caching:
                block.hash, block.token_ids = None, ()
                # not reusable content: put it first in line
                self.free_blocks[block_id] = None
                self.free_blocks.move_to_end(block_id, last=False)
            else:
                self.free_blocks[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (in reverse, so its tail is evicted first)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_published_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Keep only the blocks covering the first `num_tokens` tokens of `seq` (after a
        multi-token step rejected drafts); the others go back to the free list, first in
        line. Returns how many blocks were released."""
        keep = -(-num_tokens // self.block_size)
        n = len(seq.block_table) - keep
        for _ in range(n):
            self._release(seq.block_table.pop())
        seq.num_published_blocks = min(seq.num_published_blocks, len(seq.block_table))
        return max(n, 0)

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
