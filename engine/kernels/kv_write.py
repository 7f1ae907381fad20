"""Triton KV-cache write: each new token's K and V stored at its slot of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmpool.engine.kernels.common import strides
from llmpool.engine.kv_cache import FP8_DTYPE, FP8_MAX, LayerKVCache


@triton.jit
def _round_to_e4m3(x):
    """``x`` (fp32) rounded to the nearest e4m3 value, ties to even, as torch converts.

    The rounding is done with fp32 adds, so the cast that follows is exact: the interpreter's
    own fp8 conversion rounds ties away from zero and would not match torch bit for bit.
    Adding ``1.5 * 2**23 * step`` leaves ``step`` as the sum's last fp32 bit, where ``step``
    is e4m3's spacing at ``x``: 3 mantissa bits down to 2**-6, a fixed 2**-9 below.
    """
    bits = x.to(tl.int32, bitcast=True)
    magnitude_bits = bits & 0x7FFFFFFF
    sign = bits ^ magnitude_bits
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    step_exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6) - 3
    magic = ((step_exponent + 23) << 23 | 0x400000).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_cache(x, inv_scale, cache_ptr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """``x`` as the cache stores it: itself, or for fp8 ``x / scale`` saturated and rounded."""
    if FP8:
        x = _round_to_e4m3(tl.minimum(tl.maximum(x * inv_scale, -FP8_MAX), FP8_MAX))
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    inv_k_scale,
    inv_v_scale,
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
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
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
    key = _to_cache(key, inv_k_scale, key_cache_ptr, FP8, FP8_MAX)
    tl.store(kc_row + heads * kc_stride_h + dims, key, mask=mask)

    value = tl.load(value_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=mask).to(
        tl.float32
    )
    vc_row = value_cache_ptr + block * vc_stride_b + offset * vc_stride_o
    value = _to_cache(value, inv_v_scale, value_cache_ptr, FP8, FP8_MAX)
    tl.store(vc_row + heads * vc_stride_h + dims, value, mask=mask)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor
) -> None:
    """``torch_backend.write_kv``'s contract on the GPU; negative slots (padding tokens) are
    skipped. An fp8 cache stores ``x / scale`` as ``kv_cache.quantize_fp8`` does, bit for bit."""
    num_tokens, num_kv_heads, head_dim = key.shape
    key_cache, value_cache = cache.key, cache.value
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
        1.0 / cache.k_scale,
        1.0 / cache.v_scale,
        *strides(key, value, dims=2),
        *strides(key_cache, value_cache, dims=3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        FP8=key_cache.dtype == FP8_DTYPE,
        FP8_MAX=FP8_MAX,
    )
