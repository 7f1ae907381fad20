"""Few-row bfloat16 GEMMs on AVX-512 CPUs: ``bf16_gemm.c``, and the op that calls it.

Decode steps multiply a few rows by every weight. oneDNN's bfloat16 GEMM runs those well under
the memory roof; the kernel reads the bfloat16 weight once and accumulates in float32: on AMX
tiles where the CPU has them (an Intel Xeon with AMX, a step's GEMMs of SmolLM2: 1.8x oneDNN at
16 rows, 1.4x at 64), else with AVX-512 BF16's dot product (a 2-core Zen 4 EPYC: 2.1x oneDNN at
16 rows, 1.45x at 64), else with the weight widened to float32 (this project's 2-core Xeon: 1.5x
at 1 row, 1.7x at 16, 1.3x at 64 and at 128; ``benchmarks/bf16_gemm.py``). Whether it is used,
and up to how many rows, is measured at start (``kernels.capabilities``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from llmpool.engine.kernels.c_loader import (
    CKernel,
    avx512_only,
    with_amx,
    with_avx512_bf16,
)

# bf16_linear: the fastest way this CPU's build has; bf16_linear_widened: the weight widened to
# float32 in tiles at every row count, which the start-up probe may choose instead.
SYMBOLS = ("bf16_linear", "bf16_linear_widened")
# AVX-512 CPUs only; with AVX-512 BF16's dot product and AMX's tiles where the CPU has them.
KERNEL = CKernel(
    "bf16_gemm.c",
    {name: [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 for name in SYMBOLS},
    lambda: with_amx(with_avx512_bf16(avx512_only())),
)

# The kernel's narrower builds, each a path of the kernel that this CPU's build may pass over.
NARROWER_BUILDS = {
    "widening": avx512_only,  # the weight widened to float32
    "dot product": lambda: with_avx512_bf16(avx512_only()),  # AVX-512 BF16 without AMX
}


@functools.cache
def narrower_build(name: str) -> ctypes.CDLL | None:
    """The kernel built as ``NARROWER_BUILDS[name]``, where that differs from this CPU's build
    and the CPU can run it, so that tests and benchmarks check and time that path here too; None
    where this CPU's build is that one already, or there is none."""
    return KERNEL.narrower_build(NARROWER_BUILDS[name]())


def bf16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    library: ctypes.CDLL | None = None,
    symbol: str = "bf16_linear",
) -> torch.Tensor:
    """``x @ weight.T`` for 2-D bfloat16 CPU tensors, by ``symbol`` (one of ``SYMBOLS``);
    ``library``: another build of the kernel than this CPU's (``narrower_build``)."""
    library = library or KERNEL.built()
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"bf16_linear multiplies bfloat16, not {x.dtype} by {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"bf16_linear: shapes {tuple(x.shape)} and {tuple(weight.shape)}")
    x = x.contiguous()
    weight = weight.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    if out.numel():
        rows, (outputs, inputs) = x.shape[0], weight.shape
        multiply = getattr(library, symbol)
        multiply(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, outputs, inputs)
    return out


def bf16_linear_widened(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`bf16_linear` with the weight widened to float32, in tiles at every row count."""
    return bf16_linear(x, weight, symbol="bf16_linear_widened")


# Low-level Library API, as for ``llmpool::attention`` (a few us a call, not ~15).
_library_fragment = torch.library.Library("llmpool", "FRAGMENT")
for _name, _function in (
    ("bf16_linear", bf16_linear),
    ("bf16_linear_widened", bf16_linear_widened),
):
    _library_fragment.define(f"{_name}(Tensor x, Tensor weight) -> Tensor")
    _library_fragment.impl(_name, _function, "CompositeExplicitAutograd")
    torch.library.register_fake(f"llmpool::{_name}")(
        lambda x, weight: x.new_empty(x.shape[0], weight.shape[0])
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The opaque op inside a compiled region (inductor cannot trace a ctypes call), the
    function outside."""
    if torch.compiler.is_compiling():
        return torch.ops.llmpool.bf16_linear(x, weight)
    return bf16_linear(x, weight)


def widened_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`linear` by :func:`bf16_linear_widened`."""
    if torch.compiler.is_compiling():
        return torch.ops.llmpool.bf16_linear_widened(x, weight)
    return bf16_linear_widened(x, weight)
