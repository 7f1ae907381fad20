"""KVCacheManager: each request's block table, and the slots its next tokens will be written to."""

from __future__ import annotations

from llmpool.engine.block_pool import BlockPool
from llmpool.engine.request import Request


class KVCacheManager:
    """Maps requests to physical blocks; the model runner turns these tables into slot indices."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0 (the metric kv_cache_usage_perc)."""
        return 1.0 - self.block_pool.num_free / self.block_pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False if the pool is too short."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.block_pool.num_free:
            return False
        table.extend(self.block_pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.block_pool.release(table)

    def num_allocated_slots(self) -> int:
        return sum(len(table) for table in self.block_tables.values()) * self.block_size
