"""BlockPool: the fixed set of physical KV blocks, their reference counts and the free list."""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free; callers check ``num_free`` first."""


class BlockPool:
    """Hands out physical block ids and takes them back when their last owner lets go.

    Blocks are reference-counted so that one physical block can sit in several block tables
    (shared prefixes); a block returns to the free list only when its count drops to zero.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_blocks):
            raise NoFreeBlocksError(f"asked for {count} blocks; {len(self.free_blocks)} are free")
        blocks = [self.free_blocks.popleft() for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add an owner to blocks that are already in use."""
        for block in blocks:
            if self.ref_counts[block] < 1:
                raise ValueError(f"block {block} is free and cannot be shared")
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one owner of each block; blocks nobody owns go back to the free list.

        Released in reverse so that a request's tail blocks, the least likely to be shared,
        are reused first.
        """
        for block in reversed(blocks):
            if self.ref_counts[block] < 1:
                raise ValueError(f"block {block} released more often than it was owned")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
