"""Per-step attention metadata: where each new token's K/V goes and what each sequence attends to."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Flattened description of one step's batch, shared by every layer and every backend.

    The step's tokens are laid out sequence after sequence: sequence ``i`` owns the query rows
    ``query_start_loc[i]:query_start_loc[i + 1]``. Those rows are the *last* ``query_len`` tokens
    of a context of ``seq_lens[i]`` tokens, so query row ``r`` of sequence ``i`` sits at position
    ``seq_lens[i] - query_len + r`` and attends causally to positions ``0..`` that position.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: physical blocks, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @classmethod
    def one_sequence(
        cls, num_tokens: int, block_size: int, device: torch.device
    ) -> AttentionMetadata:
        """A prefill of ``num_tokens`` tokens written from slot 0, blocks ``0, 1, ...`` in order."""
        num_blocks = -(-num_tokens // block_size)
        return cls(
            slot_mapping=torch.arange(num_tokens, device=device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            block_size=block_size,
        )
