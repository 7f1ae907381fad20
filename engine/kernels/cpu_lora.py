"""The CPU backend's adapter deltas: ``cpu_lora.c`` for bfloat16 and float32 models, the torch
op otherwise (float16, a machine without a C compiler).

The torch op's GEMMs against every slot pay for S slots' work and a library call per GEMM; on
decode steps of a few rows per adapter that cost more than the base model's own GEMMs would
suggest (``benchmarks/lora.py``). The kernel computes each row's own slot only, in one call per
module.
"""

from __future__ import annotations

import ctypes

import torch

from llmpool.engine.kernels.c_loader import CKernel
from llmpool.engine.lora.ops import LoraWeights, TorchLoraPlan, torch_lora_add
from llmpool.engine.models.linear import GemmChoice

SYMBOLS = {torch.bfloat16: "lora_add_bf16", torch.float32: "lora_add_f32"}
_SIGNATURE = [
    *(ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64),  # x, stride, y, stride
    *(ctypes.c_void_p,) * 4,  # a, b's pointers, out_sizes, offsets
    *(ctypes.c_int64,) * 4,  # parts, num_slots, rank, in
    *(ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p),  # rows, n, slots, scales
]
# Built for this CPU's widest vector instructions (portable code elsewhere).
KERNEL = CKernel("cpu_lora.c", dict.fromkeys(SYMBOLS.values(), _SIGNATURE))


def unsupported(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights) -> str | None:
    """Why the kernel cannot take these operands, or None: it takes bfloat16 or float32 rows
    (unit column stride) and the manager's layouts (``a`` contiguous, each ``b[j]``
    ``[S, out_j, R]`` over ``[out_j, S, R]`` memory)."""
    a, b = weights.a, weights.b
    if out.dtype not in SYMBOLS or not all(t.dtype == out.dtype for t in (x, a, *b)):
        return f"one dtype of {list(SYMBOLS)} for every operand"
    if x.stride(1) != 1 or out.stride(1) != 1 or not a.is_contiguous():
        return "unit column strides and a contiguous A stack"
    if not all(b_j.permute(1, 0, 2).is_contiguous() for b_j in b):
        return "each B stack laid out as [out, S, R]"
    return None


def kernel_lora_add(
    out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: TorchLoraPlan
) -> None:
    """:func:`torch_lora_add` in ``cpu_lora.c``, for operands it takes (:func:`unsupported`:
    the caller checks, once per call)."""
    rows = plan.sorted_tokens
    if rows.numel() == 0:
        return
    a, b = weights.a, weights.b
    num_slots, parts_rank, in_features = a.shape
    parts = len(b)
    b_pointers = (ctypes.c_void_p * parts)(*(b_j.data_ptr() for b_j in b))
    out_sizes = (ctypes.c_int64 * parts)(*(b_j.shape[1] for b_j in b))
    part_offsets = (ctypes.c_int64 * parts)(*weights.offsets)
    getattr(KERNEL.built(), SYMBOLS[out.dtype])(
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        out.stride(0),
        a.data_ptr(),
        b_pointers,
        out_sizes,
        part_offsets,
        parts,
        num_slots,
        parts_rank // parts,
        in_features,
        rows.data_ptr(),
        rows.numel(),
        plan.token_slots.data_ptr(),
        plan.row_scale.data_ptr(),
    )


def cpu_lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    weights: LoraWeights,
    plan: TorchLoraPlan,
    gemm: GemmChoice,
) -> None:
    """The CPU backend's ``lora_add`` where the kernel is built: the kernel for steps of short
    groups (decodes), where it applies; the torch op's GEMMs (``gemm``: the model's choice) for
    long groups (prefill chunks), where they outrun it (at 512 rows of SmolLM2 in 8 groups of
    rank 16 they are even, at 2048 1.6x faster)."""
    if plan.groups is None and unsupported(out, x, weights) is None:
        kernel_lora_add(out, x, weights, plan)
    else:
        torch_lora_add(out, x, weights, plan, gemm)
