"""BlockPool: the fixed set of physical KV blocks, their reference counts, hashes and free list."""

from __future__ import annotations

from collections import OrderedDict

from llmpool.engine.block_hash import BlockHash


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free; callers check ``num_free`` first."""


class BlockPool:
    """Hands out physical block ids and takes them back when their last owner lets go.

    Blocks are reference-counted so that one physical block can sit in several block tables
    (shared prefixes); a block returns to the free list only when its count drops to zero.

    A full block may also carry a hash (prefix caching). A cached block whose count drops to
    zero stays cached on the free list: a later request with the same prefix can take it back
    (``touch``) until the block is handed out again, which evicts its hash. The free list is
    ordered least recently freed first, so eviction is LRU; an OrderedDict makes taking a block
    out of the middle on a cache hit O(1).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached_blocks: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out, cached-but-unowned ones included."""
        return len(self.free_blocks)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_blocks):
            raise NoFreeBlocksError(f"asked for {count} blocks; {len(self.free_blocks)} are free")
        blocks = []
        for _ in range(count):
            block, _ = self.free_blocks.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add an owner to blocks that are already in use."""
        for block in blocks:
            if self.ref_counts[block] < 1:
                raise ValueError(f"block {block} is free and cannot be shared")
            self.ref_counts[block] += 1

    def touch(self, blocks: list[int]) -> None:
        """Add an owner to cached blocks, taking back the ones that sat unowned on the free list."""
        for block in blocks:
            if self.block_hashes[block] is None:
                raise ValueError(f"block {block} is not cached")
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one owner of each block; blocks nobody owns go back to the free list.

        Released in reverse so that a request's tail blocks, the least likely to be shared,
        are reused (and their hashes evicted) first.
        """
        for block in reversed(blocks):
            if self.ref_counts[block] < 1:
                raise ValueError(f"block {block} released more often than it was owned")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Record that owned ``block`` holds the full block ``block_hash`` names.

        When another block already holds that content (two requests computed the same prefix in
        the same step), the first stays the cached one and this block stays private.
        """
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free; only owned blocks are cached")
        if block_hash in self.cached_blocks or self.block_hashes[block] is not None:
            return
        self.block_hashes[block] = block_hash
        self.cached_blocks[block_hash] = block

    def cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached_blocks.get(block_hash)

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self.cached_blocks[block_hash]
            self.block_hashes[block] = None
