"""The torch paged-attention backend against dense causal attention, one sequence at a time."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmpool.engine.attention import TORCH, AttentionMetadata
from llmpool.engine.attention.torch_backend import plan

NUM_KV_HEADS = 2
HEAD_DIM = 16


def _dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``len(query)`` positions over contiguous K/V, GQA repeated."""
    queries_per_kv = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(queries_per_kv, dim=1)
    value = value.repeat_interleave(queries_per_kv, dim=1)
    seq_len, query_len = key.shape[0], query.shape[0]
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    query_pos = torch.arange(seq_len - query_len, seq_len)
    scores.masked_fill_(torch.arange(seq_len)[None, None, :] > query_pos[None, :, None], -torch.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), value)


def _paged_batch(
    seq_lens: list[int], query_lens: list[int], block_size: int, seed: int
) -> tuple[AttentionMetadata, list[int]]:
    """Metadata with each sequence's blocks scattered over a shuffled pool; returns the slots of
    every sequence's positions, sequence after sequence."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    physical = torch.randperm(sum(blocks_per_seq) + 2, generator=generator).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    all_slots, query_slots = [], []
    for row, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table = [physical.pop() for _ in range(blocks_per_seq[row])]
        block_tables[row, : len(table)] = torch.tensor(table)
        slots = [table[pos // block_size] * block_size + pos % block_size for pos in range(seq_len)]
        all_slots += slots
        query_slots += slots[seq_len - query_len :]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(query_slots),
        query_start_loc=query_start_loc.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return meta, all_slots


def _check(
    seq_lens: list[int], query_lens: list[int], block_size: int, queries_per_kv: int
) -> None:
    meta, all_slots = _paged_batch(seq_lens, query_lens, block_size, seed=len(seq_lens))
    generator = torch.Generator().manual_seed(sum(seq_lens))
    total = sum(seq_lens)
    keys = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    values = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    num_heads = NUM_KV_HEADS * queries_per_kv
    query = torch.randn(sum(query_lens), num_heads, HEAD_DIM, generator=generator)
    num_slots = (len(all_slots) // block_size + 2 + len(seq_lens)) * block_size
    key_cache = torch.zeros(num_slots // block_size, block_size, NUM_KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    TORCH.write_kv(keys, values, key_cache, value_cache, torch.tensor(all_slots))
    scale = HEAD_DIM**-0.5

    actual = TORCH.paged_attention(query, key_cache, value_cache, TORCH.plan(meta), scale)

    token_start = query_start = 0
    for seq_len, query_len in zip(seq_lens, query_lens, strict=True):
        expected = _dense_attention(
            query[query_start : query_start + query_len],
            keys[token_start : token_start + seq_len],
            values[token_start : token_start + seq_len],
            scale,
        )
        torch.testing.assert_close(
            actual[query_start : query_start + query_len], expected, atol=2e-5, rtol=1e-5
        )
        token_start += seq_len
        query_start += query_len


def test_decodes_of_far_apart_lengths_and_prefill_chunks() -> None:
    # Decodes of 3 to 700 tokens (cut into several context groups), a whole prompt, and a
    # prefill chunk after cached context.
    seq_lens = [700, 3, 130, 17, 690, 300, 64, 260]
    query_lens = [1, 1, 1, 1, 1, 1, 64, 200]
    for block_size in (1, 16):
        _check(seq_lens, query_lens, block_size, queries_per_kv=3)


def test_plan_cuts_context_groups_and_keeps_every_query_once() -> None:
    seq_lens = [700, 20, 690, 170, 40]
    meta, _ = _paged_batch(seq_lens, [1] * len(seq_lens), block_size=16, seed=0)
    groups = plan(meta).groups
    widths = sorted(group.block_tables.shape[1] for group in groups)
    # 20 and 40 tokens share a group (2 and 3 blocks); 170 is alone (11); 690 and 700 (44).
    assert widths == [3, 11, 44]
    rows = torch.cat([group.valid_rows for group in groups]).sort().values
    assert rows.tolist() == list(range(len(seq_lens)))


@settings(max_examples=40, deadline=None)
@given(
    sequences=st.lists(
        st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
        min_size=1,
        max_size=8,
    ),
    block_size=st.sampled_from([1, 4, 16]),
    queries_per_kv=st.sampled_from([1, 3]),
)
def test_matches_dense_attention(
    sequences: list[tuple[int, int]], block_size: int, queries_per_kv: int
) -> None:
    seq_lens = [seq_len for seq_len, _ in sequences]
    query_lens = [query_len for _, query_len in sequences]
    _check(seq_lens, query_lens, block_size, queries_per_kv)
