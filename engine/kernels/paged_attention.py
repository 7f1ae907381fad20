"""Paged attention in one Triton launch: prefill chunks and decodes together, causal, with GQA."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from llmpool.engine.attention.metadata import AttentionMetadata
from llmpool.engine.kernels.common import dot_precision, matmul_dtype, strides
from llmpool.engine.kv_cache import LayerKVCache

# tl.dot needs at least 16 rows; more rows per tile reuse each loaded K/V tile for more
# queries (prefill), at the price of idle rows when a sequence has fewer queries (decode).
_MIN_TILE_ROWS = 16
_MAX_TILE_ROWS = 64
# Keys per loop step, gathered across cache blocks, so the step size (bytes in flight) does
# not depend on the engine's block size. Tall query tiles take fewer keys to save registers.
_KEYS_PER_STEP = 64
_KEYS_PER_STEP_TALL = 32
# Splitting a context across programs (flash decoding) pays off only when the grid would
# leave SMs idle, and only while each split still reads a worthwhile stretch of keys.
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 32


# Batch-dependent integers are not specialized on (Triton would compile a variant for the
# value 1), so a change of batch never stalls a serving step on a compile.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    scale,
    v_scale,
    num_seqs,
    num_tokens,
    num_heads,
    q_stride_t,
    q_stride_h,
    k_stride_b,
    k_stride_o,
    k_stride_h,
    v_stride_b,
    v_stride_o,
    v_stride_h,
    o_stride_t,
    o_stride_h,
    bt_stride,
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_KV_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: ``BLOCK_Q`` query tokens of one sequence x the query heads of one KV head,
    over one split (grid axis 2) of the sequence's context.

    Rows of the tile are (token, head-in-group) pairs, so every K/V row is loaded once for
    the whole GQA group. Softmax is computed online (flash attention) over ``BLOCK_N`` keys
    a step, each key's cache block looked up in the block table, up to the last position
    any row of the tile may see. Without ``SPLIT`` the result is final; with it, each split
    leaves its normalized output and log-sum-exp for ``_combine_splits_kernel``.

    K and V are read in the cache's dtype (fp8 too) and converted exactly to ``MMA_DTYPE``;
    an fp8 cache's ``k_scale`` comes folded into ``scale`` and ``v_scale`` scales the output.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    if seq >= num_seqs:  # the grid is sized for the worst case; spare programs do nothing
        return
    tile_start = tl.load(tile_start_ptr + tile)
    query_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - query_len

    rows = tl.arange(0, BLOCK_Q * QUERIES_PER_KV_PAD)
    token = tile_start + rows // QUERIES_PER_KV_PAD
    head_in_group = rows % QUERIES_PER_KV_PAD
    row_valid = (token < query_len) & (head_in_group < QUERIES_PER_KV)
    head = kv_head * QUERIES_PER_KV + head_in_group
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    row_mask = row_valid[:, None] & dim_valid[None, :]

    q_offsets = (query_begin + token)[:, None].to(tl.int64) * q_stride_t
    q_offsets += head[:, None] * q_stride_h + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_mask, other=0.0).to(tl.float32)
    # Fold the softmax scale and log2(e) into q once, so the loop uses exp2 directly.
    q = (q * (scale * 1.4426950408889634)).to(MMA_DTYPE)
    # Padding rows get a position past the tile's last real one: they see valid keys only,
    # and their results are never stored.
    query_pos = context_before + token

    last_token = tl.minimum(tile_start + BLOCK_Q, query_len) - 1
    num_keys = context_before + last_token + 1
    num_steps = tl.cdiv(num_keys, BLOCK_N)
    steps_per_split = tl.cdiv(num_steps, tl.num_programs(2))
    first_step = split * steps_per_split
    end_step = tl.minimum(first_step + steps_per_split, num_steps)

    m = tl.full([BLOCK_Q * QUERIES_PER_KV_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q * QUERIES_PER_KV_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * QUERIES_PER_KV_PAD, HEAD_DIM_PAD], tl.float32)
    for step in range(first_step, end_step):
        key_pos = step * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = key_pos < num_keys
        # Block numbers are loaded as integers and turned into offsets here.
        physical = tl.load(
            block_tables_ptr + seq * bt_stride + key_pos // BLOCK_SIZE, mask=key_valid, other=0
        ).to(tl.int64)
        row_in_block = key_pos % BLOCK_SIZE
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k_rows = physical * k_stride_b + row_in_block * k_stride_o + kv_head * k_stride_h
        v_rows = physical * v_stride_b + row_in_block * v_stride_o + kv_head * v_stride_h
        # Straight to the matmul dtype: a no-op on GPU, fp32 for bf16 in the interpreter.
        k = tl.load(key_cache_ptr + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        k = k.to(MMA_DTYPE)
        v = v.to(MMA_DTYPE)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        allowed = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A split that starts after a row's position masks the whole row; subtracting 0
        # instead of -inf keeps its probabilities at 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        probs = tl.exp2(scores - m_safe[:, None])
        correction = tl.exp2(m - m_safe)
        denom = denom * correction + tl.sum(probs, 1)
        acc = acc * correction[:, None] + tl.dot(
            probs.to(MMA_DTYPE), v, input_precision=DOT_PRECISION
        )
        m = m_new

    if not SPLIT:
        out = acc / denom[:, None] * v_scale
        o_offsets = (query_begin + token)[:, None].to(tl.int64) * o_stride_t
        o_offsets += head[:, None] * o_stride_h + dims[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        has_keys = denom > 0.0
        safe_denom = tl.where(has_keys, denom, 1.0)
        lse = tl.where(has_keys, m + tl.log2(safe_denom), float("-inf"))
        partial_row = (split * num_tokens + query_begin + token).to(tl.int64) * num_heads + head
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_valid)
        tl.store(
            partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :],
            acc / safe_denom[:, None] * v_scale,
            mask=row_mask,
        )


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _combine_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_tokens,
    num_heads,
    num_splits,
    o_stride_t,
    o_stride_h,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One program per (token, head): the splits' outputs weighted by their share of the sum."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    partial_row = (splits * num_tokens + token) * num_heads + head
    lse = tl.load(partial_lse_ptr + partial_row, mask=split_valid, other=float("-inf"))
    # The first split always holds keys, so the maximum is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    partial = tl.load(
        partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    out_ptrs = out_ptr + token * o_stride_t + head * o_stride_h + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


@dataclass
class TritonAttentionPlan:
    """The step's metadata plus, per tile height, which sequence and query offset each tile covers.

    Tiles are computed on the device (no host sync) the first time a layer asks for a height;
    every later layer of the step reuses them. ``num_splits`` overrides the split heuristic.
    """

    meta: AttentionMetadata
    num_splits: int | None = None
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tile_seq, tile_start)`` for a grid of ``num_tokens // block_q + num_seqs`` tiles.

        That grid bounds the real tile count (each sequence adds at most one partial tile);
        tiles past the real ones get ``tile_seq == num_seqs`` and exit at once.
        """
        if block_q not in self._tiles:
            self._tiles[block_q] = _tiles(self.meta, block_q)
        return self._tiles[block_q]


def _tiles(meta: AttentionMetadata, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    start_loc = meta.query_start_loc.to(torch.int64)
    tiles_per_seq = (start_loc[1:] - start_loc[:-1] + block_q - 1) // block_q
    tiles_end = torch.cumsum(tiles_per_seq, 0)
    grid = meta.num_tokens // block_q + meta.num_seqs
    tile = torch.arange(grid, device=start_loc.device)
    tile_seq = torch.searchsorted(tiles_end, tile, right=True)
    clamped = tile_seq.clamp(max=meta.num_seqs - 1)
    first_tile_of_seq = tiles_end[clamped] - tiles_per_seq[clamped]
    tile_start = (tile - first_tile_of_seq) * block_q
    return tile_seq.to(torch.int32), tile_start.to(torch.int32)


def plan(meta: AttentionMetadata) -> TritonAttentionPlan:
    """Wrap the metadata; tiles depend on the GQA ratio, so they are built on first use."""
    return TritonAttentionPlan(meta)


def _block_q(max_query_len: int, queries_per_kv_pad: int) -> int:
    """Query tokens per tile: enough for the longest query, within the row limits of a tile."""
    lowest = max(1, _MIN_TILE_ROWS // queries_per_kv_pad)
    highest = max(lowest, _MAX_TILE_ROWS // queries_per_kv_pad)
    return min(max(triton.next_power_of_2(max_query_len), lowest), highest)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(meta: AttentionMetadata, programs: int, device: torch.device) -> int:
    """Splits per context so that the grid covers the GPU twice over, when contexts are long."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    by_length = triton.cdiv(meta.max_seq_len, _MIN_KEYS_PER_SPLIT)
    return max(1, min(triton.cdiv(2 * sms, programs), by_length, _MAX_SPLITS))


def paged_attention(
    query: torch.Tensor, cache: LayerKVCache, attention_plan: TritonAttentionPlan, scale: float
) -> torch.Tensor:
    """``torch_backend.paged_attention``'s contract on the GPU: the scales of an fp8 cache
    are applied in the kernel (``k_scale`` with the softmax scale, ``v_scale`` to the output)."""
    num_tokens, num_heads, head_dim = query.shape
    key_cache, value_cache = cache.key, cache.value
    _, block_size, num_kv_heads, _ = key_cache.shape
    meta = attention_plan.meta
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    for tensor in (query, key_cache, value_cache):
        if tensor.stride(-1) != 1:
            raise ValueError("paged_attention needs head_dim to be the contiguous dimension")
    queries_per_kv = num_heads // num_kv_heads
    queries_per_kv_pad = triton.next_power_of_2(queries_per_kv)
    block_q = _block_q(meta.max_query_len, queries_per_kv_pad)
    tile_seq, tile_start = attention_plan.tiles(block_q)
    num_splits = attention_plan.num_splits or _num_splits(
        meta, max(meta.num_seqs, triton.cdiv(num_tokens, block_q)) * num_kv_heads, query.device
    )
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits == 1:
        partial_out = partial_lse = out  # not read: the kernel stores final results directly
    else:
        partial_out = torch.empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            (num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device
        )
    _paged_attention_kernel[(tile_seq.shape[0], num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        partial_out,
        partial_lse,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        tile_seq,
        tile_start,
        scale * cache.k_scale,
        cache.v_scale,
        meta.num_seqs,
        num_tokens,
        num_heads,
        *strides(query, dims=2),
        *strides(key_cache, value_cache, dims=3),
        *strides(out, dims=2),
        meta.block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        QUERIES_PER_KV_PAD=queries_per_kv_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=_KEYS_PER_STEP_TALL if block_q * queries_per_kv_pad > 32 else _KEYS_PER_STEP,
        SPLIT=num_splits > 1,
        MMA_DTYPE=matmul_dtype(query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            partial_out,
            partial_lse,
            out,
            num_tokens,
            num_heads,
            num_splits,
            *strides(out, dims=2),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
        )
    return out
