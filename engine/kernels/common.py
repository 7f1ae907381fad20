"""Helpers shared by the Triton kernels: interpreter detection and dtype mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """True when Triton runs kernels on CPU with numpy (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def matmul_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype fed to ``tl.dot``: the input's own on GPU so fp16/bf16 use tensor cores.

    The interpreter computes bf16 dots wrongly (it has no numpy bf16), so there bf16 is
    multiplied in fp32; fp16 keeps its own dtype so CPU tests exercise the GPU rounding.
    """
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """``ieee`` for fp32 so fp32 results match the reference; TF32 would cost ~1e-3 accuracy."""
    return "ieee" if dtype == torch.float32 else "tf32"


def strides(*tensors: torch.Tensor, dims: int) -> list[int]:
    """The leading ``dims`` strides of each tensor in turn: a launch's stride arguments (the
    last dimension's, 1, is left out; callers check it)."""
    return [stride for tensor in tensors for stride in tensor.stride()[:dims]]
