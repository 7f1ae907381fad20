"""int4 weight-only linear layers: group-wise asymmetric scales, torch's packed CPU kernel.

A weight ``w[n, k]`` is stored as a 4-bit code ``q`` in 0..15 with one bfloat16 scale and zero
per group of ``INT4_GROUP_SIZE`` input columns: ``w ≈ (q - 8) * scale + zero`` (torch's int4
convention). Groups of 32, as llama.cpp's Q4_1 (a 16-bit scale and min per 32 weights along a
row): 4 + 32/32 = 5 bits per weight, like Q4_1. The built-in model's weights are a dequantized
Q4_1 file, so groups of 32 land on its grid and keep its function (perplexity 0.99x float32's,
greedy agreement 0.96), where groups of 64 (4.5 bits) requantize onto a coarser grid:
perplexity 1.50x and greedy agreement 0.24 (tests/test_quantization.py's text and prompts).
32 also divides every width of the Llama, Mistral and Qwen2 families.

The codes are kept in the byte layout of ``torch.ops.aten._weight_int4pack_mm_for_cpu``, which
:func:`pack_int4` writes with plain tensor ops (``_convert_weight_to_int4pack_for_cpu`` writes
the same bytes, and a test checks that). That layout follows the vector width torch's CPU
kernels were dispatched for (:func:`probe_pack_block_n`), so packed weights are made in the process
that runs them, never stored. :func:`dequantize_int4` reads that layout back, so devices
without the kernel (CUDA, older torch) and the tests compute from the same bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from llmpool.engine.kernels import vnni_gemm

if TYPE_CHECKING:  # the capabilities probe this module's layout
    from llmpool.engine.kernels.capabilities import KernelCapabilities

INT4_GROUP_SIZE = 32
# The CPU kernel's layout: output channels in blocks of N (probe_pack_block_n); per block and input
# column k, byte j holds channel j in its low nibble and channel N/2 + j in its high nibble.
# Output features are a multiple of the largest block, so that a layer packs on any CPU.
PACK_BLOCK_SIZES = (64, 32)
INT4_OUT_MULTIPLE = max(PACK_BLOCK_SIZES)
INT4_MAX_CODE = 15
INT4_MID_CODE = 8
# From this many bfloat16 rows on CPUs with native bfloat16 products, int4 layers multiply
# their weight dequantized to bfloat16 (``vnni_gemm.int4_dequantize``, per call) in torch's dense
# GEMM: a step's int4 GEMMs 1.36x faster at 128 rows, 1.55x at 256 and 1.69x at 2,048 than in
# ``vnni_gemm``'s int4 kernel (1.10x at 64, 0.61x at 16) on a Zen 4 EPYC (python
# benchmarks/vnni_gemm.py): dequantizing costs the same at any batch, the kernel's integer
# products grow with it.
INT4_DEQUANTIZED_MIN_ROWS = 128
# Where ``vnni_gemm`` multiplies bfloat16 rows on AMX tiles (``vnni_gemm.int4_tiles``) they
# dequantize from this many rows instead: on a 2-core AMX Xeon a step's int4 GEMMs ran 1.83x
# faster on the tiles than dequantized at 128 rows, 1.66x at 256, 0.94x at 512, 1.01x at 768
# and 0.91x at 1,024 (python benchmarks/vnni_gemm.py --quantization int4).
INT4_TILES_DEQUANTIZED_MIN_ROWS = 512


def dequantized_min_rows(tiles: bool) -> int:
    """Rows from which bfloat16 int4 batches dequantize, where ``vnni_gemm`` runs and the CPU
    multiplies bfloat16 natively; ``tiles``: whether its int4 rows run on AMX tiles."""
    return INT4_TILES_DEQUANTIZED_MIN_ROWS if tiles else INT4_DEQUANTIZED_MIN_ROWS


def torch_has_int4_cpu_kernel() -> bool:
    """Whether this torch has its packed int4 CPU kernel (``_weight_int4pack_mm_for_cpu``)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def probe_pack_block_n() -> int:
    """Output channels per block of torch's packed layout: 64 where its CPU kernels run with
    AVX-512, 32 with AVX2 (``vec::Vectorized<float>::size() * 4``), found by packing a probe
    with torch's own converter; 64 where torch has none (only this module reads the bytes).
    Probed once per engine (``KernelCapabilities.int4_pack_block``)."""
    converter = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if converter is None or not torch_has_int4_cpu_kernel():
        return INT4_OUT_MULTIPLE
    codes = torch.randint(
        0,
        INT4_MAX_CODE + 1,
        (INT4_OUT_MULTIPLE, INT4_GROUP_SIZE),
        generator=torch.Generator().manual_seed(0),
        dtype=torch.int32,
    )
    converted = converter(codes, 1)
    for block in PACK_BLOCK_SIZES:
        if torch.equal(pack_int4(codes, block), converted):
            return block
    raise RuntimeError("torch's int4 CPU layout is none this module knows")


def check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    if out_features % INT4_OUT_MULTIPLE or in_features % group_size:
        raise ValueError(
            f"int4 needs output features divisible by {INT4_OUT_MULTIPLE} and input features by"
            f" {group_size}; this layer is {out_features}x{in_features}"
        )


def quantize_groups_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` (uint8, 0..15) and bfloat16 ``scales_and_zeros`` ``[K / group, N, 2]``.

    Each group's range [min, max] maps onto the 16 codes; the codes are rounded against the
    bfloat16 scale and zero that are stored, so the stored values are what the error is
    measured from.
    """
    out_features, in_features = weight.shape
    check_int4_shape(out_features, in_features, group_size)
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((high - low) / INT4_MAX_CODE).clamp(min=1e-8).to(torch.bfloat16).float()
    zero = (low + INT4_MID_CODE * scale).to(torch.bfloat16).float()
    codes = torch.round((groups - zero[..., None]) / scale[..., None]) + INT4_MID_CODE
    codes = codes.clamp(0, INT4_MAX_CODE).to(torch.uint8).reshape(out_features, in_features)
    scales_and_zeros = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()
    return codes, scales_and_zeros.to(torch.bfloat16)


def pack_int4(codes: torch.Tensor, block: int) -> torch.Tensor:
    """``[N, K]`` codes to the kernel's ``[N, K / 2]`` bytes, in output blocks of ``block``
    (:func:`probe_pack_block_n`)."""
    out_features, in_features = codes.shape
    blocks = codes.to(torch.uint8).reshape(-1, 2, block // 2, in_features)
    packed = blocks[:, 0] | (blocks[:, 1] << 4)  # [N / block, block / 2, K]
    return packed.transpose(1, 2).contiguous().reshape(out_features, in_features // 2)


def unpack_int4_transposed(packed: torch.Tensor, block: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4`, transposed: ``[K, N]`` codes (uint8).

    Transposed because that order needs one copy of the bytes: in the kernel's layout the
    channels of one input column already sit together (a block's worth).
    """
    out_features, half_in = packed.shape
    in_features = 2 * half_in
    half_block = block // 2
    by_column = packed.reshape(-1, in_features, half_block).transpose(0, 1)  # [K, N/block, b/2]
    codes = torch.stack([by_column & 0xF, by_column >> 4], dim=2)  # [K, N/block, 2, b/2]
    return codes.reshape(in_features, out_features)


def dequantize_int4(
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    block: int,
    group_size: int = INT4_GROUP_SIZE,
) -> torch.Tensor:
    """The float32 ``[N, K]`` weight the packed codes stand for (a transposed view): the
    reference path, ``code * scale + (zero - 8 * scale)``."""
    codes = unpack_int4_transposed(packed, block)
    in_features, out_features = codes.shape
    scale, zero = scales_and_zeros.float().unbind(dim=2)  # [K / group, N] each
    offset = zero - INT4_MID_CODE * scale
    groups = codes.float().view(-1, group_size, out_features)
    weight = torch.addcmul(offset[:, None], groups, scale[:, None])
    return weight.view(in_features, out_features).t()


class Int4Linear(nn.Module):
    """``y = x @ dequantize(weight).T + bias`` with 4-bit codes and group-wise scales and zeros.

    On CPU, rows run ``vnni_gemm``'s kernel where it is built (the rows split into two int8
    parts, 15 bits): against torch's kernel on a step of SmolLM2's layers 1.0-1.6x from one row
    to 2,048 on a Zen 4 EPYC (python benchmarks/vnni_gemm.py); where its build has AMX tiles,
    bfloat16 rows from ``vnni_gemm.INT4_AMX_MIN_ROWS`` multiply the weight dequantized group by
    group on tiles instead (1.7x at 16 rows, 2.9x at 64 on a 2-core AMX Xeon). Otherwise
    torch's fused kernel runs in bfloat16 whatever the activations' dtype: its float32 variant
    is scalar code (on this project's CPU 34x slower than the dense float32 matmul at one row,
    700x at 64), while the bfloat16 one reads the packed weight once and accumulates in
    float32. Elsewhere the weight is dequantized per call (the reference path). Where
    ``vnni_gemm`` runs on a CPU that multiplies bfloat16 natively, bfloat16 batches of
    ``INT4_DEQUANTIZED_MIN_ROWS`` or more (prefill; ``INT4_TILES_DEQUANTIZED_MIN_ROWS`` where the
    rows run on tiles) multiply the weight dequantized by its C code, in torch's bfloat16 GEMM.

    The scales and zeros are held as the int16 bits of their bfloat16 values, so that
    ``module.to(dtype)`` leaves them alone (as the uint8 codes) and the kernel gets them as they
    were quantized against.
    """

    weight: torch.Tensor
    scales_and_zeros_bits: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: KernelCapabilities,
        group_size: int = INT4_GROUP_SIZE,
    ) -> None:
        super().__init__()
        self.group_size = group_size
        self.register_buffer("weight", weight)
        self.register_buffer("scales_and_zeros_bits", scales_and_zeros.view(torch.int16))
        self.register_buffer("bias", bias)
        self.use_kernels(kernels)

    def use_kernels(self, kernels: KernelCapabilities) -> None:
        """Plain attributes that a compiled forward reads without tracing a probe: the packed
        layout's block, whether torch's kernel exists, whether rows run ``vnni_gemm``, whether
        large bfloat16 batches dequantize."""
        self.pack_block = kernels.int4_pack_block
        self.torch_kernel = kernels.torch_int4
        self.vnni = (
            kernels.vnni_gemm
            and self.group_size == vnni_gemm.INT4_GROUP
            and self.pack_block == vnni_gemm.INT4_BLOCK
        )
        self.dequantizes = self.vnni and kernels.native_bf16
        self.dequantized_min_rows = kernels.int4_dequantized_min_rows

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelCapabilities
    ) -> Int4Linear:
        codes, scales_and_zeros = quantize_groups_int4(weight)
        bias = None if bias is None else bias.detach().clone()
        return cls(pack_int4(codes, kernels.int4_pack_block), scales_and_zeros, bias, kernels)

    @property
    def scales_and_zeros(self) -> torch.Tensor:
        return self.scales_and_zeros_bits.view(torch.bfloat16)

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.weight, self.scales_and_zeros, self.pack_block, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if (
            x.device.type == "cpu"
            and self.dequantizes
            and x.dtype == torch.bfloat16
            and rows.shape[0] >= self.dequantized_min_rows
        ):
            out = rows @ vnni_gemm.int4_dequantize_op(self.weight, self.scales_and_zeros_bits)
        elif x.device.type == "cpu" and self.vnni:
            out = vnni_gemm.int4_op(rows, self.weight, self.scales_and_zeros_bits)
        elif x.device.type == "cpu" and self.torch_kernel:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(torch.bfloat16), self.weight, self.group_size, self.scales_and_zeros
            )
        else:
            out = nn.functional.linear(rows, self.dequantize().to(x.dtype))
        out = out.reshape(*x.shape[:-1], -1).to(x.dtype)
        return out if self.bias is None else out + self.bias
