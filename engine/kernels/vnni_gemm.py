"""int8 (few-row) and int4 weight-only GEMMs on AVX-512 VNNI CPUs: ``vnni_gemm.c``, and the ops
that call it.

Decode steps multiply a few rows by every weight. torch's weight-only kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) round the rows to bfloat16 and stream
the weight at about half the memory roof at one row. These kernels multiply integers with VNNI
on the rows split into two int8 parts, ``quantization.int8_split_matmul``'s 15 bits a row: the
int8 kernel computes that matmul's numbers, so int8 layers give the same result at every batch
size, and the int4 kernel is ~50x closer to the dequantized product than torch's. The int4
kernel's rows share each unpacking of the codes, so it stays ahead of torch's at every row
count (1.0-1.6x from 1 to 2,048 rows on a Zen 4 EPYC); large bfloat16 batches multiply the
weight dequantized (:func:`int4_dequantize`) in torch's dense GEMM instead. Where the CPU has AMX
tiles, bfloat16 rows from ``INT4_AMX_MIN_ROWS`` multiply that same dequantized weight, a group of
32 columns at a time, on tiles, without writing it out.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from llmpool.engine.cpu_features import cpu_flags
from llmpool.engine.kernels.c_loader import (
    AVX512_BUILD,
    CKernel,
    avx512_only,
    with_amx,
    with_avx512_bf16,
)

VNNI_BUILD = [*AVX512_BUILD, "-mavx512vnni", "-mavx512vbmi"]
# vpdpbusd adds unsigned by signed byte products: the int8 kernel stores x's parts plus this
# bias and takes off the bias times each weight row's sum.
PART_BIAS = 128
# The int4 kernel's group of input columns (one scale and zero each) and block of outputs.
INT4_GROUP = 32
INT4_BLOCK = 64
# Rows from which bfloat16 rows of the int4 kernel run on AMX tiles (vnni_gemm.c).
INT4_AMX_MIN_ROWS = 6


def _vnni_build() -> list[str] | None:
    """CPUs with AVX-512 VNNI and VBMI; with AMX's bfloat16 tiles too where the CPU has them
    (bfloat16 rows of int4 layers multiply the dequantized weight on tiles)."""
    if avx512_only() is None or not {"avx512_vnni", "avx512vbmi"} <= cpu_flags():
        return None
    return with_amx(with_avx512_bf16(VNNI_BUILD))


KERNEL = CKernel(
    "vnni_gemm.c",
    {
        "int8_linear": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3,
        "int4_linear": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3,
        "int4_linear_bf16": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3,
        "int4_dequantize_bf16": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2,
    },
    _vnni_build,
)


def int4_tiles() -> bool:
    """Whether this CPU's build multiplies bfloat16 int4 rows on AMX tiles."""
    return "-mamx-bf16" in (KERNEL.arch() or [])


@functools.cache
def integer_build() -> ctypes.CDLL | None:
    """The kernels built without AMX tiles (bfloat16 rows in the integer kernel at every row
    count), where that differs from this CPU's build, so that tests and benchmarks check and time
    that path here too; None where this CPU's build is that one already, or there is none."""
    return KERNEL.narrower_build(None if KERNEL.arch() is None else VNNI_BUILD)


def weight_sums(weight: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel takes off each output for the parts' bias: ``128 * weight.sum(1)``."""
    return weight.sum(dim=1, dtype=torch.int32) * PART_BIAS


def _rows(x: torch.Tensor, inputs: int, name: str, keep_bfloat16: bool = False) -> torch.Tensor:
    """``x`` as the kernel's contiguous rows: float32, or bfloat16 kept where asked."""
    if x.dim() != 2 or x.shape[1] != inputs:
        raise ValueError(f"{name}: rows of shape {tuple(x.shape)} for {inputs} inputs")
    if keep_bfloat16 and x.dtype == torch.bfloat16:
        return x.contiguous()
    return x.float().contiguous()


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` in float32 for 2-D CPU tensors: ``x`` float32 or
    bfloat16, ``weight`` int8, ``sums`` from :func:`weight_sums`, ``scale`` float32."""
    library = KERNEL.built()
    if weight.dtype != torch.int8 or sums.dtype != torch.int32 or scale.dtype != torch.float32:
        raise ValueError(
            f"int8_linear takes int8 weights, int32 sums and float32 scales, not {weight.dtype},"
            f" {sums.dtype} and {scale.dtype}"
        )
    outputs, inputs = weight.shape
    if sums.shape != (outputs,) or scale.shape != (outputs,):
        raise ValueError(
            f"int8_linear: sums {tuple(sums.shape)} and scales {tuple(scale.shape)}"
            f" for {outputs} outputs"
        )
    x = _rows(x, inputs, "int8_linear")
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


def _check_int4(
    packed: torch.Tensor, scales_and_zeros_bits: torch.Tensor, name: str
) -> tuple[int, int]:
    """The outputs and inputs of int4 operands in torch's layout; a ValueError for others."""
    if packed.dtype != torch.uint8 or scales_and_zeros_bits.dtype != torch.int16:
        raise ValueError(
            f"{name} takes uint8 codes and int16 scale bits, not {packed.dtype} and"
            f" {scales_and_zeros_bits.dtype}"
        )
    outputs, inputs = packed.shape[0], 2 * packed.shape[1]
    if (
        outputs % INT4_BLOCK
        or inputs % INT4_GROUP
        or scales_and_zeros_bits.shape != (inputs // INT4_GROUP, outputs, 2)
    ):
        raise ValueError(
            f"{name}: codes {tuple(packed.shape)} and scales"
            f" {tuple(scales_and_zeros_bits.shape)} (groups of {INT4_GROUP}, blocks of"
            f" {INT4_BLOCK} outputs)"
        )
    return outputs, inputs


def int4_dequantize(packed: torch.Tensor, scales_and_zeros_bits: torch.Tensor) -> torch.Tensor:
    """``dequantize_int4(packed, scales_and_zeros).T.bfloat16()``, ``[K, N]`` contiguous (the
    same bits): what a dense bfloat16 GEMM multiplies large batches by."""
    library = KERNEL.built()
    outputs, inputs = _check_int4(packed, scales_and_zeros_bits, "int4_dequantize")
    packed, scales_and_zeros_bits = packed.contiguous(), scales_and_zeros_bits.contiguous()
    out = packed.new_empty(inputs, outputs, dtype=torch.bfloat16)
    library.int4_dequantize_bf16(
        packed.data_ptr(), scales_and_zeros_bits.data_ptr(), out.data_ptr(), outputs, inputs
    )
    return out


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros_bits: torch.Tensor,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """``x @ dequantize_int4(packed, scales_and_zeros).T`` in float32 for 2-D CPU tensors: ``x``
    float32 or bfloat16, ``packed`` ``[N, K / 2]`` uint8 in torch's layout (``int4.pack_int4``),
    the bfloat16 scales and zeros ``[K / 32, N, 2]`` as their int16 bits.

    Where the build has AMX tiles, bfloat16 rows from ``INT4_AMX_MIN_ROWS`` on multiply the
    weight as :func:`int4_dequantize` rounds it (the product a dense bfloat16 GEMM of the
    dequantized weight computes, up to summation order); other rows run the integer kernel.
    ``library``: another build of the kernels (:func:`integer_build`), else this CPU's."""
    library = library or KERNEL.built()
    outputs, inputs = _check_int4(packed, scales_and_zeros_bits, "int4_linear")
    x = _rows(x, inputs, "int4_linear", keep_bfloat16=True)
    packed, scales_and_zeros_bits = packed.contiguous(), scales_and_zeros_bits.contiguous()
    out = x.new_empty(x.shape[0], outputs, dtype=torch.float32)
    if out.numel():
        (library.int4_linear_bf16 if x.dtype == torch.bfloat16 else library.int4_linear)(
            x.data_ptr(),
            packed.data_ptr(),
            scales_and_zeros_bits.data_ptr(),
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
_library_fragment.define("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros) -> Tensor")
_library_fragment.impl("int4_linear", int4_linear, "CompositeExplicitAutograd")
_library_fragment.define("int4_dequantize(Tensor packed, Tensor scales_and_zeros) -> Tensor")
_library_fragment.impl("int4_dequantize", int4_dequantize, "CompositeExplicitAutograd")


@torch.library.register_fake("llmpool::int8_linear")
def _(
    x: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.register_fake("llmpool::int4_linear")
def _(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0], dtype=torch.float32)


@torch.library.register_fake("llmpool::int4_dequantize")
def _(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return packed.new_empty(2 * packed.shape[1], packed.shape[0], dtype=torch.bfloat16)


def int8_op(
    x: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """:func:`int8_linear`, as the opaque op inside a compiled region (inductor cannot trace a
    ctypes call)."""
    if torch.compiler.is_compiling():
        return torch.ops.llmpool.int8_linear(x, weight, sums, scale)
    return int8_linear(x, weight, sums, scale)


def int4_op(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros_bits: torch.Tensor
) -> torch.Tensor:
    """:func:`int4_linear`, as the opaque op inside a compiled region."""
    if torch.compiler.is_compiling():
        return torch.ops.llmpool.int4_linear(x, packed, scales_and_zeros_bits)
    return int4_linear(x, packed, scales_and_zeros_bits)


def int4_dequantize_op(packed: torch.Tensor, scales_and_zeros_bits: torch.Tensor) -> torch.Tensor:
    """:func:`int4_dequantize`, as the opaque op inside a compiled region."""
    if torch.compiler.is_compiling():
        return torch.ops.llmpool.int4_dequantize(packed, scales_and_zeros_bits)
    return int4_dequantize(packed, scales_and_zeros_bits)
