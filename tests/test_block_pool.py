"""Property tests of the KV block pool and the per-request block tables built on it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmpool.engine.block_pool import BlockPool, NoFreeBlocksError
from llmpool.engine.kv_cache_manager import KVCacheManager
from llmpool.engine.request import Request
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.scheduler import Scheduler


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    prompt: list[int] | None = None,
    cache_salt: str | None = None,
) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    token_ids = list(range(prompt_len)) if prompt is None else prompt
    return Request(request_id, token_ids, params, frozenset(), cache_salt=cache_salt)


def assert_pool_consistent(manager: KVCacheManager) -> None:
    """Counts match owners, no block is owned and free, the cache index matches block hashes."""
    pool = manager.block_pool
    owners: dict[int, int] = {}
    for table in manager.block_tables.values():
        for block in table:
            owners[block] = owners.get(block, 0) + 1
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] >= 0
        assert pool.ref_counts[block] == owners.get(block, 0)
    free = list(pool.free_blocks)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    assert set(free).isdisjoint(owners), "a block is both free and owned"
    assert len(free) + len(owners) == pool.num_blocks
    assert {pool.block_hashes[block]: block for block in pool.cached_blocks.values()} == (
        pool.cached_blocks
    ), "the cache index and the blocks' hashes disagree"
    assert sum(h is not None for h in pool.block_hashes) == len(pool.cached_blocks)


def test_release_of_a_free_block_is_refused() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.release(blocks)
    with pytest.raises(ValueError, match="released more often"):
        pool.release(blocks[:1])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(8, 64),
    block_size=st.sampled_from([1, 4, 16]),
    operations=st.lists(
        st.tuples(
            st.sampled_from(["grow", "free", "share"]), st.integers(0, 7), st.integers(1, 40)
        ),
        max_size=80,
    ),
)
def test_block_tables_never_double_own(num_blocks: int, block_size: int, operations: list) -> None:
    manager = KVCacheManager(num_blocks, block_size)
    # Prompts longer than the pool, so every grow step stays inside known tokens.
    requests = {i: make_request(str(i), 64 * 16 + 1, 1) for i in range(8)}
    for action, index, amount in operations:
        request = requests[index]
        if action == "grow":
            if manager.allocate_slots(request, amount):
                request.num_computed_tokens += amount
        elif action == "free":
            manager.free(request)
            request.num_computed_tokens = 0
        else:  # share another request's full blocks, as a prefix hit would
            donor = manager.block_tables.get(str((index + 1) % 8), [])
            if donor and not manager.block_tables.get(request.request_id):
                manager.block_pool.share(donor)
                manager.block_tables[request.request_id] = list(donor)
                request.num_computed_tokens = len(donor) * block_size
        assert_pool_consistent(manager)
    for request in requests.values():
        manager.free(request)
    assert manager.num_free_blocks == num_blocks


def test_cached_blocks_survive_release_until_reallocated() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2)
    first = make_request("a", 5, 1)
    assert manager.allocate_slots(first, 5)
    manager.free(first)
    assert manager.num_free_blocks == 4
    second = make_request("b", 5, 1)
    computed = manager.get_computed_blocks(second)
    assert len(computed) == 2  # 4 of 5 prompt tokens; the last one must be computed
    assert manager.allocate_slots(second, 1, computed)
    assert manager.block_tables["b"][:2] == computed
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 4)
    manager.free(second)
    # Four fresh blocks evict every hash: nothing is left to hit.
    assert manager.allocate_slots(make_request("c", 8, 1, prompt=[9] * 8), 8)
    assert manager.get_computed_blocks(make_request("d", 5, 1)) == []


def test_whole_prompt_is_never_taken_from_the_cache() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    assert manager.allocate_slots(make_request("a", 8, 1), 8)
    assert len(manager.get_computed_blocks(make_request("b", 8, 1))) == 1
    assert len(manager.get_computed_blocks(make_request("c", 9, 1))) == 2


def test_cache_salt_separates_tenants() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    assert manager.allocate_slots(make_request("a", 9, 1, cache_salt="tenant-1"), 9)
    assert manager.get_computed_blocks(make_request("b", 9, 1)) == []
    assert manager.get_computed_blocks(make_request("c", 9, 1, cache_salt="tenant-2")) == []
    assert len(manager.get_computed_blocks(make_request("d", 9, 1, cache_salt="tenant-1"))) == 2


def test_disabled_prefix_caching_neither_hits_nor_counts() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert manager.allocate_slots(make_request("a", 9, 1), 9)
    assert manager.get_computed_blocks(make_request("b", 9, 1)) == []
    assert not manager.block_pool.cached_blocks
    assert manager.prefix_cache_queries == manager.prefix_cache_hits == 0


PREFIX_FAMILIES = 3

prompt_specs = st.tuples(
    st.integers(0, PREFIX_FAMILIES - 1),  # which shared prefix
    st.integers(0, 40),  # how much of it
    st.integers(0, 10),  # a suffix of the request's own
    st.integers(1, 24),  # max_tokens
)


def family_prompt(index: int, family: int, shared: int, own: int) -> list[int]:
    prompt = [100 * family + j for j in range(shared)] + [1000 + 50 * index + j for j in range(own)]
    return prompt or [1]


@settings(max_examples=150, deadline=None)
@given(
    enable_prefix_caching=st.booleans(),
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 16]),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
    specs=st.lists(prompt_specs, min_size=1, max_size=10),
    abort_at=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=5),
)
def test_scheduler_returns_every_block(
    enable_prefix_caching: bool,
    num_blocks: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
    specs: list[tuple[int, int, int, int]],
    abort_at: list[tuple[int, int]],
) -> None:
    """Run the scheduler with fake sampling over prompts that share prefixes.

    Preemption, chunking, aborts and cache hits leak no block, and a fake KV cache (each slot
    holds the token prefix it was computed from) shows that every position a request attends
    to holds its own prefix's K/V, whether it computed that block or found it cached.
    """
    max_model_len = num_blocks * block_size
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    scheduler = Scheduler(manager, max_num_seqs, budget, max_model_len)
    for i, (family, shared, own, max_tokens) in enumerate(specs):
        prompt = family_prompt(i, family, shared, own)
        if len(prompt) < max_model_len:
            scheduler.add_request(make_request(str(i), 0, max_tokens, prompt=prompt))
    aborts = dict(abort_at)
    fake_kv: dict[int, tuple[int, ...]] = {}
    for step in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        if step in aborts:
            scheduler.abort_request(str(aborts[step]))
        output = scheduler.schedule()
        assert output.total_num_scheduled_tokens <= budget
        assert len(scheduler.running) <= max_num_seqs
        scheduled = list(zip(output.requests, output.num_scheduled_tokens, strict=True))
        for request, count in scheduled:  # every layer writes before it attends
            table = manager.block_tables[request.request_id]
            for position in range(request.num_computed_tokens, request.num_computed_tokens + count):
                slot = table[position // block_size] * block_size + position % block_size
                fake_kv[slot] = tuple(request.all_token_ids[: position + 1])
        for request, count in scheduled:
            table = manager.block_tables[request.request_id]
            for position in range(request.num_computed_tokens + count):
                slot = table[position // block_size] * block_size + position % block_size
                assert fake_kv[slot] == tuple(request.all_token_ids[: position + 1])
        sampled = {
            r.request_id: [7 + int(r.request_id) % 2]
            for r, n in scheduled
            if r.num_computed_tokens + n == r.num_tokens
        }
        scheduler.update_from_output(output, sampled)
        assert_pool_consistent(manager)
    assert not scheduler.has_unfinished_requests()
    assert manager.num_free_blocks == num_blocks
    assert not manager.block_tables
    assert manager.prefix_cache_hits <= manager.prefix_cache_queries
