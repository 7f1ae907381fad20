"""Triton rotary embedding (neox / rotate-half style) of queries and keys in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmpool.engine.kernels.common import strides


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    src_stride_t,
    src_stride_h,
    dst_stride_t,
    dst_stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate every head of one token: ``(a, b) -> (a cos - b sin, b cos + a sin)`` by halves."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    src = src_ptr + token * src_stride_t + heads * src_stride_h + dims
    first = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * dst_stride_t + heads * dst_stride_h + dims
    out_dtype = dst_ptr.dtype.element_ty
    tl.store(dst, (first * cos - second * sin).to(out_dtype), mask=mask)
    tl.store(dst + HALF, (second * cos + first * sin).to(out_dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    query_out_ptr,
    key_out_ptr,
    cos_sin_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    qo_stride_t,
    qo_stride_h,
    ko_stride_t,
    ko_stride_h,
    cache_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """One program per token: rotate all its query heads and key heads by its position."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    cache_row = cos_sin_ptr + position * cache_stride + dims
    # The reference casts cos/sin to the query dtype before multiplying; round them the same way.
    in_dtype = query_ptr.dtype.element_ty
    cos = tl.load(cache_row, mask=dims < HALF, other=0.0).to(in_dtype).to(tl.float32)
    sin = tl.load(cache_row + HALF, mask=dims < HALF, other=0.0).to(in_dtype).to(tl.float32)
    _rotate_heads(
        query_ptr, query_out_ptr, token, q_stride_t, q_stride_h, qo_stride_t, qo_stride_h,
        cos, sin, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD,
    )  # fmt: skip
    _rotate_heads(
        key_ptr, key_out_ptr, token, k_stride_t, k_stride_h, ko_stride_t, ko_stride_h,
        cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` ``[T, heads, D]`` and ``key`` ``[T, kv_heads, D]``; inputs are not modified.

    ``cos_sin_cache`` is ``[max_positions, D]``: cosines in the first half, sines in the second.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    for tensor in (query, key, cos_sin_cache):
        if tensor.stride(-1) != 1:
            raise ValueError("rotary_embedding needs the last dimension to be contiguous")
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        query_out,
        key_out,
        cos_sin_cache,
        *strides(query, key, query_out, key_out, dims=2),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
    )
    return query_out, key_out
