"""int4 GEMMs of one or two rows on AVX-512 CPUs: ``int4_gemm.c``, and the op that calls it.

torch's ``_weight_int4pack_mm_for_cpu`` streams an int4 weight at about a third of the memory
roof at one row, which is most of an int4 model's decode step at one request. The kernel reads
the same packed bytes (``int4.py``'s layout) and computes the same function up to summation
order. Whether it is used is measured at start (``probe``), and only for the rows where it
wins (``MAX_ROWS``): from 4 rows torch's kernel is as fast.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmpool.engine import cpu_kernels
from llmpool.engine.models.linear import measure_speedup

SOURCE = Path(__file__).with_name("int4_gemm.c")
SIGNATURES = {"int4_linear": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4}
MAX_ROWS = 2
MIN_SPEEDUP = 1.1

_max_rows: int | None = None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernel, on CPUs with AVX-512 (its only build)."""
    if cpu_kernels.arch_flags() != cpu_kernels.AVX512_BUILD:
        return None
    return cpu_kernels.build(SOURCE, cpu_kernels.AVX512_BUILD, SIGNATURES)


def available() -> bool:
    return _library() is not None


def set_max_rows(max_rows: int | None) -> None:
    """Run int4 GEMMs of at most ``max_rows`` rows on CPU in the kernel (None: never).

    Process-wide, as the CPU it describes; the engine sets it from :func:`probe`.
    """
    global _max_rows
    _max_rows = max_rows


def max_rows() -> int | None:
    return _max_rows


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros_bits: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x @ dequantize_int4(packed, scales_and_zeros).T`` in bfloat16, for 2-D bfloat16 ``x``
    and the contiguous buffers of an ``Int4Linear``."""
    library = _library()
    if library is None:
        raise RuntimeError("the int4 GEMM kernel is not built")
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"int4_linear multiplies 2-D bfloat16 rows, not {x.dtype} {x.dim()}-D")
    outputs, inputs = packed.shape[0], 2 * packed.shape[1]
    if x.shape[1] != inputs or inputs % group_size:
        raise ValueError(f"int4_linear: {tuple(x.shape)} rows against {outputs}x{inputs} codes")
    x = x.contiguous()
    out = x.new_empty(x.shape[0], outputs)
    if out.numel():
        library.int4_linear(
            x.data_ptr(),
            packed.data_ptr(),
            scales_and_zeros_bits.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            outputs,
            inputs,
            group_size,
        )
    return out


_library_fragment = torch.library.Library("llmpool", "FRAGMENT")
_library_fragment.define(
    "int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros_bits, int group_size) -> Tensor"
)
_library_fragment.impl("int4_linear", int4_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("llmpool::int4_linear")
def _(x: torch.Tensor, packed: torch.Tensor, *rest: object) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def linear(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros_bits: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The opaque op inside a compiled region, the function outside."""
    if torch.compiler.is_compiling():
        return torch.ops.llmpool.int4_linear(x, packed, scales_and_zeros_bits, group_size)
    return int4_linear(x, packed, scales_and_zeros_bits, group_size)


def probe(
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    rows: int = 1,
    repeats: int = 7,
) -> float:
    """How many times faster the kernel multiplies ``rows`` rows by the int4 weight than
    torch's packed kernel on this CPU."""
    x = torch.randn(rows, 2 * packed.shape[1], dtype=torch.bfloat16)
    bits = scales_and_zeros.view(torch.int16)
    return measure_speedup(
        lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros),
        lambda: int4_linear(x, packed, bits, group_size),
        repeats,
    )
