"""Steps of several sequences over a paged cache, for the attention tests of every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmpool.engine.attention.metadata import AttentionMetadata

# Blocks of the pool that no sequence owns, so that a kernel reading a wrong block reads
# numbers no reference attends to.
SPARE_BLOCKS = 3


@dataclass(frozen=True)
class PagedBatch:
    """One step's metadata, the slot of every position of every sequence (sequence after
    sequence, whole contexts: what a test writes K and V to), and the pool's block count."""

    meta: AttentionMetadata
    all_slots: list[int]
    num_blocks: int


def scattered_batch(
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """Sequences whose blocks lie scattered over a shuffled pool; each one's queries are the
    last ``query_len`` positions of its ``seq_len``."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + SPARE_BLOCKS
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    all_slots: list[int] = []
    query_slots: list[int] = []
    for row, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table = [physical.pop() for _ in range(blocks_per_seq[row])]
        block_tables[row, : len(table)] = torch.tensor(table)
        slots = [table[pos // block_size] * block_size + pos % block_size for pos in range(seq_len)]
        all_slots += slots
        query_slots += slots[seq_len - query_len :]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(query_slots, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return PagedBatch(meta, all_slots, num_blocks)
