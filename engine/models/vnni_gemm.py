"""Few-row int8 and int4 weight-only GEMMs on AVX-512 VNNI CPUs: ``vnni_gemm.c``, and the ops
that call it.

Decode steps multiply a few rows by every weight. torch's weight-only kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) round the rows to bfloat16 and stream
the weight at about half the memory roof at one row. These kernels multiply bytes by bytes with
VNNI on the rows split into two int8 parts, ``quantization.int8_split_matmul``'s 15 bits a row:
the int8 kernel computes that matmul's numbers, so int8 layers give the same result at every
batch size, and the int4 kernel is ~50x closer to the dequantized product than torch's.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmpool.engine import cpu_kernels
from llmpool.engine.cpu_features import cpu_flags

SOURCE = Path(__file__).with_name("vnni_gemm.c")
SIGNATURES = {
    "int8_linear": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3,
    "int4_linear": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3,
}
VNNI_BUILD = [*cpu_kernels.AVX512_BUILD, "-mavx512vnni", "-mavx512vbmi"]
# vpdpbusd adds unsigned by signed byte products: the int8 kernel stores x's parts plus this
# bias and takes off the bias times each weight row's sum.
PART_BIAS = 128
# The int4 kernel's group of input columns (one scale and zero each) and block of outputs.
INT4_GROUP = 32
INT4_BLOCK = 64

# Whether quantized layers call the kernels; None until the first enabled() decides (and builds).
_enabled: bool | None = None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernels, on CPUs with AVX-512 VNNI and VBMI (their only build)."""
    if cpu_kernels.arch_flags() != cpu_kernels.AVX512_BUILD:
        return None
    if not {"avx512_vnni", "avx512vbmi"} <= cpu_flags():
        return None
    return cpu_kernels.build(SOURCE, VNNI_BUILD, SIGNATURES)


def available() -> bool:
    return _library() is not None


def enabled() -> bool:
    """Whether quantized layers call the kernels: where they are built, unless switched off.

    ``quantization.quantize`` calls this before any forward, so that a compiled forward reads a
    settled flag instead of tracing the build (which would break its graph).
    """
    global _enabled
    if _enabled is None:
        _enabled = available()
    return _enabled


def set_enabled(enabled: bool) -> None:
    """Switch the kernels on (where built) or off, process-wide: ``benchmarks/vnni_gemm.py``
    measures them against torch's kernels this way."""
    global _enabled
    _enabled = enabled and available()


def _built() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the VNNI GEMM kernels are not built")
    return library


def weight_sums(weight: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel takes off each output for the parts' bias: ``128 * weight.sum(1)``."""
    return weight.sum(dim=1, dtype=torch.int32) * PART_BIAS


def _rows(x: torch.Tensor, inputs: int, name: str) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != inputs:
        raise ValueError(f"{name}: rows of shape {tuple(x.shape)} for {inputs} inputs")
    return x.float().contiguous()


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` in float32 for 2-D CPU tensors: ``x`` float32 or
    bfloat16, ``weight`` int8, ``sums`` from :func:`weight_sums`, ``scale`` float32."""
    library = _built()
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


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros_bits: torch.Tensor
) -> torch.Tensor:
    """``x @ dequantize_int4(packed, scales_and_zeros).T`` in float32 for 2-D CPU tensors: ``x``
    float32 or bfloat16, ``packed`` ``[N, K / 2]`` uint8 in torch's layout (``int4.pack_int4``),
    the bfloat16 scales and zeros ``[K / 32, N, 2]`` as their int16 bits."""
    library = _built()
    if packed.dtype != torch.uint8 or scales_and_zeros_bits.dtype != torch.int16:
        raise ValueError(
            f"int4_linear takes uint8 codes and int16 scale bits, not {packed.dtype} and"
            f" {scales_and_zeros_bits.dtype}"
        )
    outputs, inputs = packed.shape[0], 2 * packed.shape[1]
    if (
        outputs % INT4_BLOCK
        or inputs % INT4_GROUP
        or scales_and_zeros_bits.shape != (inputs // INT4_GROUP, outputs, 2)
    ):
        raise ValueError(
            f"int4_linear: codes {tuple(packed.shape)} and scales"
            f" {tuple(scales_and_zeros_bits.shape)} (groups of {INT4_GROUP}, blocks of"
            f" {INT4_BLOCK} outputs)"
        )
    x = _rows(x, inputs, "int4_linear")
    packed, scales_and_zeros_bits = packed.contiguous(), scales_and_zeros_bits.contiguous()
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


@torch.library.register_fake("llmpool::int8_linear")
def _(
    x: torch.Tensor, weight: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.register_fake("llmpool::int4_linear")
def _(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0], dtype=torch.float32)


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
