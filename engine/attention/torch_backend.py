"""Paged attention in plain torch: the reference backend, and the production path on CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmpool.engine.attention.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` at their cache slots.

    Caches are ``[num_blocks, block_size, kv_heads, head_dim]``; slot ``s`` is row
    ``s // block_size``, offset ``s % block_size``.
    """
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )


@dataclass
class _Group:
    """Sequences attended together, their queries padded to one length."""

    block_tables: torch.Tensor  # [G, blocks]
    query_rows: (
        torch.Tensor
    )  # [G * max_q] token row for each padded query slot (padding reads row 0)
    valid_slots: torch.Tensor  # [n] positions in the padded layout that hold real tokens
    valid_rows: torch.Tensor  # [n] the token rows they belong to
    mask: torch.Tensor  # [G, 1, max_q, blocks * block_size] True where attention is allowed
    max_query_len: int


@dataclass
class TorchAttentionPlan:
    """Index tensors built once per step so that every layer only gathers and attends."""

    groups: list[_Group]


def plan(meta: AttentionMetadata) -> TorchAttentionPlan:
    """Group sequences by query length (powers of two), each group padded on its own.

    Padding a 1-token decode, or a 20-token prompt tail after a prefix-cache hit, to a 2,048-token
    prefill chunk would multiply the work, so sequences whose query lengths share a power-of-two
    bucket are attended together: at most one call per bucket, queries padded to the group's
    longest and contexts to its longest, with a boolean mask keeping attention causal.
    """
    query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).to(torch.int64)
    seq_lens = meta.seq_lens.to(torch.int64)
    device = meta.seq_lens.device
    groups = []
    buckets = torch.ceil(torch.log2(query_lens.to(torch.float32))).to(torch.int64)
    for bucket in torch.unique(buckets).tolist():
        selected = buckets == bucket
        seq_ids = torch.nonzero(selected).flatten()
        group_query_lens = query_lens[seq_ids]
        group_seq_lens = seq_lens[seq_ids]
        max_q = int(group_query_lens.max())
        max_ctx = int(group_seq_lens.max())
        num_blocks = -(-max_ctx // meta.block_size)
        num_ctx = num_blocks * meta.block_size
        starts = meta.query_start_loc[seq_ids].to(torch.int64)

        offsets = torch.arange(max_q, device=device)
        is_real = offsets[None, :] < group_query_lens[:, None]  # [G, max_q]
        rows = starts[:, None] + offsets[None, :]
        query_rows = torch.where(is_real, rows, torch.zeros_like(rows)).flatten()
        valid_slots = torch.nonzero(is_real.flatten()).flatten()

        # Query r of a sequence sits at position seq_len - query_len + r.
        query_pos = (group_seq_lens - group_query_lens)[:, None] + offsets[None, :]
        key_pos = torch.arange(num_ctx, device=device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [G, max_q, ctx]
        groups.append(
            _Group(
                block_tables=meta.block_tables[seq_ids, :num_blocks].to(torch.int64),
                query_rows=query_rows,
                valid_slots=valid_slots,
                valid_rows=query_rows[valid_slots],
                mask=mask[:, None, :, :],
                max_query_len=max_q,
            )
        )
    return TorchAttentionPlan(groups=groups)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attention_plan: TorchAttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[num_tokens, heads, head_dim]`` over paged K/V."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)
    for group in attention_plan.groups:
        num_seqs = group.block_tables.shape[0]
        q = query.index_select(0, group.query_rows)
        q = q.view(num_seqs, group.max_query_len, num_heads, head_dim).transpose(1, 2)
        k = key_cache[group.block_tables].view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = (
            value_cache[group.block_tables]
            .view(num_seqs, -1, num_kv_heads, head_dim)
            .transpose(1, 2)
        )
        attended = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        attended = attended.transpose(1, 2).reshape(-1, num_heads, head_dim)
        out.index_copy_(0, group.valid_rows, attended.index_select(0, group.valid_slots))
    return out
