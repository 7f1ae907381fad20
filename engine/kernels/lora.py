"""LoRA deltas for the rows of a step, grouped by adapter slot: shrink, then expand per part.

Semantics are those of :func:`llmpool.engine.lora.ops.torch_lora_add`. Unlike the torch path,
groups are not padded: each program covers ``BLOCK_M`` rows of one group, and programs past
their group's end return at once, so a step with one long prefill group and short decode groups
does no padded work. The adapter stacks are single tensors indexed by the group's slot.

1. shrink: ``s[i, :] = x[sorted_tokens[i]] · A[slot]ᵀ`` into an fp32 scratch of
   ``[adapter rows, parts · R]`` (``i`` is the row's place in ``sorted_tokens``);
2. expand, one launch per part ``j``: ``out[t, off_j : off_j + out_j] +=
   scaling[slot] · s[i, jR : (j+1)R] · B_j[slot]ᵀ``, added in fp32, stored in ``out``'s dtype.

A row is in at most one group, so no two programs write the same element: no atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmpool.engine.kernels.common import dot_precision, matmul_dtype, strides
from llmpool.engine.lora.ops import LoraBatch, LoraWeights

# tl.dot needs at least 16 rows, columns and reduction length.
_MIN_DOT = 16
# Rows per program: up to a group's length, so decode groups (a few rows) do not waste tiles.
_MAX_BLOCK_M = 64
_BLOCK_K = 32
_BLOCK_N = 64


@dataclass(frozen=True)
class TritonLoraPlan:
    """The step's groups as the model runner built them, plus the slots' scaling.

    ``block_m`` is the rows per program (chosen from ``max_group_len``; tests override it)."""

    sorted_tokens: torch.Tensor
    group_slots: torch.Tensor
    group_starts: torch.Tensor
    scaling: torch.Tensor
    max_group_len: int
    block_m: int

    @property
    def num_rows(self) -> int:
        return self.sorted_tokens.numel()

    @property
    def num_groups(self) -> int:
        return self.group_slots.numel()


def lora_plan(batch: LoraBatch, scaling: torch.Tensor) -> TritonLoraPlan:
    """Wrap the batch; no device work, so the plan costs nothing per step."""
    block_m = min(max(triton.next_power_of_2(batch.max_group_len), _MIN_DOT), _MAX_BLOCK_M)
    return TritonLoraPlan(
        sorted_tokens=batch.sorted_tokens,
        group_slots=batch.group_slots,
        group_starts=batch.group_starts,
        scaling=scaling,
        max_group_len=batch.max_group_len,
        block_m=block_m,
    )


@triton.jit
def _group_tile(sorted_tokens_ptr, group_slots_ptr, group_starts_ptr, BLOCK_M: tl.constexpr):
    """This program's tile of rows (group: grid axis 0, tile: axis 1): its places in
    ``sorted_tokens``, which of them are in the group, their rows of the flat batch (0 where
    masked), the group's slot, and whether the tile starts past the group's end (the grid is
    sized for the longest group; such a program returns at once)."""
    group = tl.program_id(0)
    start = tl.load(group_starts_ptr + group)
    end = tl.load(group_starts_ptr + group + 1)
    first = start + tl.program_id(1) * BLOCK_M
    places = first + tl.arange(0, BLOCK_M)
    valid = places < end
    tokens = tl.load(sorted_tokens_ptr + places, mask=valid, other=0)
    slot = tl.load(group_slots_ptr + group).to(tl.int64)
    return places, valid, tokens, slot, first >= end


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    shrunk_ptr,
    sorted_tokens_ptr,
    group_slots_ptr,
    group_starts_ptr,
    in_features,
    x_stride,
    a_stride_s,
    a_stride_r,
    shrunk_stride,
    PARTS_R: tl.constexpr,
    PARTS_R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: ``BLOCK_M`` rows of one group x all ``parts · R`` columns."""
    places, valid, tokens, slot, past_end = _group_tile(
        sorted_tokens_ptr, group_slots_ptr, group_starts_ptr, BLOCK_M
    )
    if past_end:
        return
    ranks = tl.arange(0, PARTS_R_PAD)
    rank_valid = ranks < PARTS_R
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * x_stride
    a_rows = a_ptr + slot * a_stride_s + ranks[:, None] * a_stride_r
    acc = tl.zeros([BLOCK_M, PARTS_R_PAD], tl.float32)
    for k in range(0, in_features, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_valid = cols < in_features
        x = tl.load(x_rows + cols[None, :], mask=valid[:, None] & col_valid[None, :], other=0.0)
        a = tl.load(
            a_rows + cols[None, :], mask=rank_valid[:, None] & col_valid[None, :], other=0.0
        )
        acc += tl.dot(x.to(MMA_DTYPE), tl.trans(a.to(MMA_DTYPE)), input_precision=DOT_PRECISION)
    offsets = places.to(tl.int64)[:, None] * shrunk_stride + ranks[None, :]
    tl.store(shrunk_ptr + offsets, acc, mask=valid[:, None] & rank_valid[None, :])


@triton.jit
def _expand_kernel(
    shrunk_ptr,
    b_ptr,
    out_ptr,
    scaling_ptr,
    sorted_tokens_ptr,
    group_slots_ptr,
    group_starts_ptr,
    out_features,
    part_column,
    out_column,
    shrunk_stride,
    b_stride_s,
    b_stride_n,
    out_stride,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MMA_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: ``BLOCK_M`` rows of one group x ``BLOCK_N`` columns (grid axis 2) of one
    part's output."""
    ranks = tl.arange(0, RANK_PAD)
    rank_valid = ranks < RANK
    columns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_valid = columns < out_features
    places, valid, tokens, slot, past_end = _group_tile(
        sorted_tokens_ptr, group_slots_ptr, group_starts_ptr, BLOCK_M
    )
    if past_end:
        return
    shrunk = tl.load(
        shrunk_ptr + places.to(tl.int64)[:, None] * shrunk_stride + (part_column + ranks)[None, :],
        mask=valid[:, None] & rank_valid[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot * b_stride_s + columns[:, None] * b_stride_n + ranks[None, :],
        mask=column_valid[:, None] & rank_valid[None, :],
        other=0.0,
    )
    delta = tl.dot(shrunk.to(MMA_DTYPE), tl.trans(b.to(MMA_DTYPE)), input_precision=DOT_PRECISION)
    delta *= tl.load(scaling_ptr + slot)
    out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * out_stride + (out_column + columns)[None, :]
    mask = valid[:, None] & column_valid[None, :]
    current = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (current + delta).to(out_ptr.dtype.element_ty), mask=mask)


def lora_add(
    out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: TritonLoraPlan
) -> None:
    """``out[t, off_j : off_j + out_j] += scale · (x[t] · A[slot, jR:(j+1)R]ᵀ) · B_j[slot]ᵀ``
    for every row ``t`` of a group (``LoraWeights``), as in the torch reference."""
    if plan.num_rows == 0:
        return
    a, b, offsets = weights.a, weights.b, weights.offsets
    if x.stride(-1) != 1 or out.stride(-1) != 1 or a.stride(-1) != 1:
        raise ValueError("lora_add needs the feature dimension of x, out and A to be contiguous")
    parts_r = a.shape[1]
    rank = parts_r // len(b)
    shrunk = torch.empty((plan.num_rows, parts_r), dtype=torch.float32, device=x.device)
    # What both kernels take alike: the step's groups, rows per program and the dot's types.
    groups = (plan.sorted_tokens, plan.group_slots, plan.group_starts)
    tiling = {
        "BLOCK_M": plan.block_m,
        "MMA_DTYPE": matmul_dtype(x.dtype),
        "DOT_PRECISION": dot_precision(x.dtype),
    }
    row_tiles = triton.cdiv(plan.max_group_len, plan.block_m)
    _shrink_kernel[(plan.num_groups, row_tiles)](
        x,
        a,
        shrunk,
        *groups,
        x.shape[1],
        x.stride(0),
        *strides(a, dims=2),
        shrunk.stride(0),
        PARTS_R=parts_r,
        PARTS_R_PAD=max(_MIN_DOT, triton.next_power_of_2(parts_r)),
        BLOCK_K=_BLOCK_K,
        **tiling,
    )
    for j, (b_j, offset) in enumerate(zip(b, offsets, strict=True)):
        if b_j.stride(-1) != 1:
            raise ValueError("lora_add needs the rank dimension of B to be contiguous")
        out_features = b_j.shape[1]
        _expand_kernel[(plan.num_groups, row_tiles, triton.cdiv(out_features, _BLOCK_N))](
            shrunk,
            b_j,
            out,
            plan.scaling,
            *groups,
            out_features,
            j * rank,
            offset,
            shrunk.stride(0),
            *strides(b_j, dims=2),
            out.stride(0),
            RANK=rank,
            RANK_PAD=max(_MIN_DOT, triton.next_power_of_2(rank)),
            BLOCK_N=_BLOCK_N,
            **tiling,
        )
