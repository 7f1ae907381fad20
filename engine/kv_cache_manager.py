"""KVCacheManager: each request's block table, prefix-cache lookups, and the blocks tokens go to."""

from __future__ import annotations

from collections.abc import Sequence

from llmpool.engine.block_hash import extend_block_hashes
from llmpool.engine.block_pool import BlockPool
from llmpool.engine.request import Request


class KVCacheManager:
    """Maps requests to physical blocks; the model runner turns these tables into slot indices.

    With prefix caching, every full block a request computes is hashed and cached; a new (or
    preempted) request starts from the longest run of cached blocks its tokens begin with.
    ``prefix_cache_queries`` and ``prefix_cache_hits`` count tokens, as vLLM's metrics do: the
    tokens of each admitted request, and those of them found in the cache.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        # Blocks of each table already offered to the cache, so each is hashed and cached once.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks the request's tokens start with; changes nothing.

        Never all of its tokens: the last one must run through the model to give logits, so a
        prompt of exactly ``k`` cached blocks reuses ``k - 1`` of them.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False (and no change) if short.

        ``computed_blocks`` is the cached prefix of a request being admitted, from
        ``get_computed_blocks``: those blocks are shared, and the new tokens come after them.
        """
        pool = self.block_pool
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = (
            self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(computed_blocks)
        )
        # Cached blocks nobody owns sit on the free list: taking them back uses up free blocks.
        num_reclaimed = sum(1 for block in computed_blocks if pool.ref_counts[block] == 0)
        if max(needed, 0) + num_reclaimed > pool.num_free:
            if not table:
                del self.block_tables[request.request_id]
            return False
        if not table and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
        pool.touch(list(computed_blocks))
        table.extend(computed_blocks)
        if needed > 0:
            table.extend(pool.allocate(needed))
        if self.enable_prefix_caching:
            # Blocks this step will fill are cached now: a request admitted later in the same
            # step can share them, since every layer writes K/V before it attends. Slots past
            # the request's tokens hold drafts, which may be rejected: never cached.
            self._cache_full_blocks(
                request, table, min(num_computed + num_new_tokens, request.num_tokens)
            )
        return True

    def free(self, request: Request) -> None:
        self.num_cached_blocks.pop(request.request_id, None)
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.block_pool.release(table)

    def _update_block_hashes(self, request: Request) -> None:
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.block_salt
        )

    def _cache_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        num_full = min(num_tokens // self.block_size, len(table))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for index in range(start, num_full):
            self.block_pool.cache(table[index], request.block_hashes[index])
        self.num_cached_blocks[request.request_id] = num_full
