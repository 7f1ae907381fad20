"""Triton KV-cache write: each new token's K and V stored at its slot of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    kc_stride_b,
    kc_stride_o,
    kc_stride_h,
    vc_stride_b,
    vc_stride_o,
    vc_stride_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its ``[kv_heads, head_dim]`` K and V rows into the cache.

    Values pass through fp32 (exact for fp16/bf16) because the interpreter cannot hold bf16.
    """
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a negative slot marks a padding token that owns no cache space
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    key = tl.load(key_ptr + token * k_stride_t + heads * k_stride_h + dims, mask=mask).to(
        tl.float32
    )
    kc_row = key_cache_ptr + block * kc_stride_b + offset * kc_stride_o
    tl.store(kc_row + heads * kc_stride_h + dims, key.to(key_cache_ptr.dtype.element_ty), mask=mask)

    value = tl.load(value_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=mask).to(
        tl.float32
    )
    vc_row = value_cache_ptr + block * vc_stride_b + offset * vc_stride_o
    tl.store(
        vc_row + heads * vc_stride_h + dims, value.to(value_cache_ptr.dtype.element_ty), mask=mask
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` at their cache slots.

    Caches are ``[num_blocks, block_size, kv_heads, head_dim]``; slot ``s`` is block
    ``s // block_size``, offset ``s % block_size``. Negative slots are skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for tensor in (key, value, key_cache, value_cache):
        if tensor.stride(-1) != 1:
            raise ValueError("write_kv needs head_dim to be the contiguous dimension")
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )
