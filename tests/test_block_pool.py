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


def make_request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, list(range(prompt_len)), params, frozenset())


def assert_pool_consistent(manager: KVCacheManager) -> None:
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
    requests = {i: make_request(str(i), 1, 1) for i in range(8)}
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


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 16]),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
    specs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24)), min_size=1, max_size=10),
    abort_at=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=5),
)
def test_scheduler_returns_every_block(
    num_blocks: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
    specs: list[tuple[int, int]],
    abort_at: list[tuple[int, int]],
) -> None:
    """Run the scheduler with fake sampling: preemption, chunking and aborts leak no block."""
    max_model_len = num_blocks * block_size
    manager = KVCacheManager(num_blocks, block_size)
    scheduler = Scheduler(manager, max_num_seqs, budget, max_model_len)
    for i, (prompt_len, max_tokens) in enumerate(specs):
        if prompt_len < max_model_len:
            scheduler.add_request(make_request(str(i), prompt_len, max_tokens))
    aborts = dict(abort_at)
    for step in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        if step in aborts:
            scheduler.abort_request(str(aborts[step]))
        output = scheduler.schedule()
        assert output.total_num_scheduled_tokens <= budget
        assert len(scheduler.running) <= max_num_seqs
        sampled = {
            r.request_id: 7
            for r, n in zip(output.requests, output.num_scheduled_tokens, strict=True)
            if r.num_computed_tokens + n == r.num_tokens
        }
        scheduler.update_from_output(output, sampled)
        assert_pool_consistent(manager)
    assert not scheduler.has_unfinished_requests()
    assert manager.num_free_blocks == num_blocks
    assert not manager.block_tables
