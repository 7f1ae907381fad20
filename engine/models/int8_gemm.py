"""Few-row int8 weight-only GEMMs on AVX-512 VNNI CPUs: ``int8_gemm.c``, and the op that calls it.

Decode steps multiply a few rows by every weight. torch's weight-only int8 kernel
(``_weight_int8pack_mm``) rounds the rows to bfloat16 and streams the weight at about half the
memory roof at one row; the kernel multiplies bytes by bytes with VNNI and computes
``quantization.int8_split_matmul``'s numbers (the rows split into two int8 parts, 15 bits), so
int8 layers give the same result at every batch size.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmpool.engine import cpu_kernels
from llmpool.engine.cpu_features import cpu_flags

SOURCE = Path(__file__).with_name("int8_gemm.c")
SIGNATURES = {"int8_linear": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3}
VNNI_BUILD = [*cpu_kernels.AVX512_BUILD, "-mavx512vnni"]
# vpdpbusd adds unsigned by signed byte products: the kernel stores x's parts plus this bias
# and takes off the bias times each weight row's sum.
PART_BIAS = 128


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernel, on CPUs with AVX-512 VNNI (its only build)."""
    if cpu_kernels.arch_flags() != cpu_kernels.AVX512_BUILD or "avx512_vnni" not in cpu_flags():
        return None
    return cpu_kernels.build(SOURCE, VNNI_BUILD, SIGNATURES)


_enabled = True


def available() -> bool:
    return _library() is not None


def set_enabled(enabled: bool) -> None:
    """Whether int8 layers call the kernel where it is built (process-wide; on by default,
    switched off to measure against torch's kernel: ``benchmarks/int8_gemm.py``)."""
    global _enabled
    _enabled = enabled


def enabled() -> bool:
    return _enabled and available()


def weight_sums(weight: torch.Tensor) -> torch.Tensor:
    """What the kernel takes off each output for the parts' bias: ``128 * weight.sum(1)``."""
    return weight.sum(dim=1, dtype=torch.int32) * PART_BIAS


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` in float32 for 2-D CPU tensors: ``x`` float32 or
    bfloat16, ``weight`` int8, ``sums`` from :func:`weight_sums`, ``scale`` float32."""
    library = _library()
    if library is None:
        raise RuntimeError("the int8 GEMM kernel is not built")
    if weight.dtype != torch.int8 or sums.dtype != torch.int32 or scale.dtype != torch.float32:
        raise ValueError(
            f"int8_linear takes int8 weights, int32 sums and float32 scales, not {weight.dtype},"
            f" {sums.dtype} and {scale.dtype}"
        )
    outputs, inputs = weight.shape
    if (
        x.dim() != 2
        or x.shape[1] != inputs
        or sums.shape != (outputs,)
        or scale.shape != (outputs,)
    ):
        raise ValueError(
            f"int8_linear: shapes {tuple(x.shape)}, {tuple(weight.shape)}, {tuple(sums.shape)}"
            f" and {tuple(scale.shape)}"
        )
    x = x.float().contiguous()
    weight, sums, scale = weight.contiguous(), sums.contiguous(), scale.contiguous()
    out = x.new_empty(x.shape[0], outputs)
    if out.numel():
        library.int8_linear(
            x.data_ptr(),
            weight.data_ptr(),
            sums.data_ptr(),
            scale.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            outputs,
            inputs,
        )
    return out


# Low-level Library API, as for ``llmpool::attention`` (a few us a call, not ~15).
_library_fragment = torch.library.Library("llmpool", "FRAGMENT")
_library_fragment.define(
    "int8_linear(Tensor x, Tensor weight, Tensor sums, Tensor scale) -> Tensor"
)
_library_fragment.impl("int8_linear", int8_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("llmpool::int8_linear")
def _(
    x: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def linear(
    x: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The opaque op inside a compiled region (inductor cannot trace a ctypes call), the
    function outside."""
    if torch.compiler.is_compiling():
        return torch.ops.llmpool.int8_linear(x, weight, sums, scale)
    return int8_linear(x, weight, sums, scale)
