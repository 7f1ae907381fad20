"""Few-row float32 and bfloat16 GEMMs on AVX2 CPUs: ``avx2_gemm.c``, and the ops that call it.

Decode steps multiply a few rows by every weight. On CPUs without AVX-512, torch streams a float32
weight at about half the memory bandwidth at one row and emulates bfloat16; these kernels read
the weight once per tile of 4 rows and multiply in float32 (a 2-core AVX2 AMD EPYC, a step's
GEMMs of SmolLM2: float32 2.2x as fast at 1 row, 1.35x at 16; bfloat16 1.4x at 1 row, 6.6x at
16; ``benchmarks/avx2_gemm.py``). Whether they run is measured at start
(``kernels.capabilities``); on AVX-512 CPUs ``bf16_gemm.c`` takes bfloat16 instead.
"""

from __future__ import annotations

import ctypes

import torch

from llmpool.engine.kernels.c_loader import CKernel, avx2_or_wider

SIGNATURE = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3

KERNEL = CKernel("avx2_gemm.c", {"f32_linear": SIGNATURE, "bf16_linear": SIGNATURE}, avx2_or_wider)


def _gemm(symbol: str, dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` through ``symbol`` for 2-D CPU tensors of ``dtype``."""
    library = KERNEL.built()
    if x.dtype != dtype or weight.dtype != dtype:
        raise ValueError(f"{symbol} multiplies {dtype}, not {x.dtype} by {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{symbol}: shapes {tuple(x.shape)} and {tuple(weight.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    if out.numel():
        rows, (outputs, inputs) = x.shape[0], weight.shape
        getattr(library, symbol)(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, outputs, inputs
        )
    return out


def f32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for 2-D float32 CPU tensors."""
    return _gemm("f32_linear", torch.float32, x, weight)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for 2-D bfloat16 CPU tensors, accumulated in float32 and rounded once."""
    return _gemm("bf16_linear", torch.bfloat16, x, weight)


# Low-level Library API, as for ``llmpool::attention`` (a few us a call, not ~15).
_library_fragment = torch.library.Library("llmpool", "FRAGMENT")
for _name, _function in (("avx2_f32_linear", f32_linear), ("avx2_bf16_linear", bf16_linear)):
    _library_fragment.define(f"{_name}(Tensor x, Tensor weight) -> Tensor")
    _library_fragment.impl(_name, _function, "CompositeExplicitAutograd")
    torch.library.register_fake(f"llmpool::{_name}")(
        lambda x, weight: x.new_empty(x.shape[0], weight.shape[0])
    )


def f32_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`f32_linear`, as the opaque op inside a compiled region (inductor cannot trace a
    ctypes call)."""
    if torch.compiler.is_compiling():
        return torch.ops.llmpool.avx2_f32_linear(x, weight)
    return f32_linear(x, weight)


def bf16_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`bf16_linear`, as the opaque op inside a compiled region."""
    if torch.compiler.is_compiling():
        return torch.ops.llmpool.avx2_bf16_linear(x, weight)
    return bf16_linear(x, weight)
