"""Paged attention in plain torch: the reference backend, and the production path on CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmpool.engine.attention.metadata import AttentionMetadata
from llmpool.engine.kv_cache import FP8_DTYPE, LayerKVCache, quantize_fp8


def write_kv(
    key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` at their cache slots.

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size``. An fp8 cache stores
    ``x / scale`` (``quantize_fp8``), copied as bytes: index_copy_ has no float8 kernel on CPU.
    """
    key_cache, value_cache = cache.key, cache.value
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if key_cache.dtype == FP8_DTYPE:
        key, value = quantize_fp8(key, cache.k_scale), quantize_fp8(value, cache.v_scale)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
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


# A group's padded context is cut when it exceeds its shortest context by both this factor and
# this many tokens: below that, gathering the padding costs less than another call per layer.
MAX_CONTEXT_PADDING = 1.25
MIN_CONTEXT_PADDING_TOKENS = 128


def plan(meta: AttentionMetadata) -> TorchAttentionPlan:
    """Group sequences by query length and then by context length, each group padded on its own.

    Padding a 1-token decode, or a 20-token prompt tail after a prefix-cache hit, to a 2,048-token
    prefill chunk would multiply the work, so sequences whose query lengths share a power-of-two
    bucket are attended together. Within a bucket, padding every context to the longest one
    would gather and attend over blocks nobody uses (decodes of 100 and 700 tokens side by side),
    so sequences sorted by context length are cut into groups whose longest context is within
    ``MAX_CONTEXT_PADDING`` times, or ``MIN_CONTEXT_PADDING_TOKENS`` tokens, of their shortest.
    Each group is one call: queries padded to the group's longest, contexts to its longest, a
    boolean mask keeping attention causal.
    """
    return plan_sequences(meta, torch.arange(meta.num_seqs, device=meta.seq_lens.device))


def plan_sequences(meta: AttentionMetadata, seq_ids: torch.Tensor) -> TorchAttentionPlan:
    """:func:`plan` for the sequences ``seq_ids`` of the step only (the others' rows of the
    output are left unwritten)."""
    query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).to(torch.int64)
    seq_lens = meta.seq_lens.to(torch.int64)
    blocks_needed = (seq_lens + meta.block_size - 1) // meta.block_size
    buckets = torch.ceil(torch.log2(query_lens[seq_ids].to(torch.float32))).to(torch.int64)
    groups = []
    for bucket in torch.unique(buckets).tolist():
        in_bucket = seq_ids[buckets == bucket]
        in_bucket = in_bucket[torch.argsort(blocks_needed[in_bucket], stable=True)]
        context_lens = (blocks_needed[in_bucket] * meta.block_size).tolist()
        for group_ids in _split_by_context(in_bucket, context_lens):
            groups.append(_group(meta, group_ids, query_lens[group_ids], seq_lens[group_ids]))
    return TorchAttentionPlan(groups=groups)


def _split_by_context(seq_ids: torch.Tensor, context_lens: list[int]) -> list[torch.Tensor]:
    """Cut ``seq_ids``, sorted by context length (in whole blocks), where padding grows too much."""
    cuts = [0]
    for index, context in enumerate(context_lens):
        shortest = context_lens[cuts[-1]]
        if (
            context > MAX_CONTEXT_PADDING * shortest
            and context - shortest > MIN_CONTEXT_PADDING_TOKENS
        ):
            cuts.append(index)
    cuts.append(len(context_lens))
    return [seq_ids[begin:end] for begin, end in zip(cuts, cuts[1:], strict=False)]


def _group(
    meta: AttentionMetadata,
    seq_ids: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
) -> _Group:
    device = meta.seq_lens.device
    max_q = int(query_lens.max())
    num_blocks = -(-int(seq_lens.max()) // meta.block_size)
    num_ctx = num_blocks * meta.block_size
    starts = meta.query_start_loc[seq_ids].to(torch.int64)

    offsets = torch.arange(max_q, device=device)
    is_real = offsets[None, :] < query_lens[:, None]  # [G, max_q]
    rows = starts[:, None] + offsets[None, :]
    query_rows = torch.where(is_real, rows, torch.zeros_like(rows)).flatten()
    valid_slots = torch.nonzero(is_real.flatten()).flatten()

    # Query r of a sequence sits at position seq_len - query_len + r.
    query_pos = (seq_lens - query_lens)[:, None] + offsets[None, :]
    key_pos = torch.arange(num_ctx, device=device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [G, max_q, ctx]
    return _Group(
        block_tables=meta.block_tables[seq_ids, :num_blocks].to(torch.int64),
        query_rows=query_rows,
        valid_slots=valid_slots,
        valid_rows=query_rows[valid_slots],
        mask=mask[:, None, :, :],
        max_query_len=max_q,
    )


def paged_attention(
    query: torch.Tensor, cache: LayerKVCache, attention_plan: TorchAttentionPlan, scale: float
) -> torch.Tensor:
    """Causal attention of ``query`` ``[num_tokens, heads, head_dim]`` over paged K/V.

    The cache holds ``K / k_scale`` and ``V / v_scale``: ``k_scale`` joins the softmax scale
    and ``v_scale`` multiplies the output, which is the same as dequantizing every row read.
    """
    key_cache, value_cache, v_scale = cache.key, cache.value, cache.v_scale
    scale *= cache.k_scale
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)
    for group in attention_plan.groups:
        num_seqs = group.block_tables.shape[0]
        blocks = group.block_tables.flatten()
        # index_select copies whole blocks, which is faster than advanced indexing on CPU.
        k = key_cache.index_select(0, blocks).view(num_seqs, -1, num_kv_heads, head_dim)
        v = value_cache.index_select(0, blocks).view(num_seqs, -1, num_kv_heads, head_dim)
        k = k.transpose(1, 2).to(query.dtype)
        v = v.transpose(1, 2).to(query.dtype)
        q = query.index_select(0, group.query_rows)
        if group.max_query_len == 1:
            # Decodes: the query heads that share a KV head become that head's query rows, so
            # attention reads each K/V head once instead of expanding it to every query head.
            q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
            attended = attended.reshape(num_seqs, num_heads, head_dim)
        else:
            q = q.view(num_seqs, group.max_query_len, num_heads, head_dim).transpose(1, 2)
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=num_heads != num_kv_heads
            )
            attended = attended.transpose(1, 2).reshape(-1, num_heads, head_dim)
        out.index_copy_(0, group.valid_rows, attended.index_select(0, group.valid_slots))
    return out if v_scale == 1.0 else out * v_scale
