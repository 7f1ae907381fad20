"""What this engine's kernels can do here, probed once per engine and passed down.

The C kernels build or not with the machine (a compiler, AVX2, AVX-512, VNNI), torch's packed
int4 layout follows the vector width torch was dispatched for, and whether the few-row C GEMMs
(or, for bfloat16, a float32 upcast) outrun torch's is measured. The engine probes all of it once at start
(:func:`probe_kernels`) and gives the result to the backends and layers that choose by it; each
layer keeps what it reads as plain attributes fixed before any forward, so that a compiled
forward reads settled values instead of tracing a probe (which would break its graph).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from llmpool.engine.cpu_features import native_bfloat16_flags
from llmpool.engine.kernels import (
    avx2_gemm,
    bf16_gemm,
    cpu_decode,
    cpu_decoder,
    cpu_layer_ops,
    cpu_lora,
    cpu_prefill,
    vnni_gemm,
)
from llmpool.engine.models import int4, linear
from llmpool.engine.models.linear import TORCH_GEMMS, GemmChoice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelCapabilities:
    """Which kernels an engine runs; the defaults are torch alone (no C kernel built)."""

    cpu_decode: bool = False  # cpu_decode.c: the CPU attention backend's decodes
    cpu_prefill: bool = False  # cpu_prefill.c: its multi-token queries (AVX2 or AVX-512)
    cpu_lora: bool = False  # cpu_lora.c: the CPU backend's adapter deltas
    cpu_layer_ops: bool = False  # cpu_layer_ops.c: the CPU backend's norms and rotary
    cpu_decoder: bool = False  # cpu_decoder.c: decode steps' layers in one call (those kernels')
    bf16_gemm: bool = False  # bf16_gemm.c is built (AVX-512); whether it runs: ``gemm``
    avx2_gemm: bool = False  # avx2_gemm.c is built (AVX2 and FMA); whether it runs: ``gemm``
    vnni_gemm: bool = False  # vnni_gemm.c: int8 decodes, int4 GEMMs (AVX-512 VNNI and VBMI)
    torch_int4: bool = False  # torch's own packed int4 CPU kernel exists
    # The CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX), so torch's bfloat16 GEMM runs at
    # its full rate: large int4 batches dequantize to it (int4.INT4_DEQUANTIZED_MIN_ROWS).
    native_bf16: bool = False
    int4_pack_block: int = int4.INT4_OUT_MULTIPLE  # output block of torch's int4 layout
    gemm: GemmChoice = TORCH_GEMMS  # which GEMMs run where


def probe_kernels(
    device: torch.device,
    dtype: torch.dtype | None = None,
    weight_shape: tuple[int, int] | None = None,
) -> KernelCapabilities:
    """The capabilities of an engine on ``device``: on CPU the C kernels are built (or found in
    the cache) now. For a float32 or bfloat16 model on CPU, ``weight_shape`` (the widest dense
    projection; None for quantized layers, which have their own kernels) is the GEMM the choices
    of ``gemm`` are measured on."""
    on_cpu = device.type == "cpu"
    kernels = KernelCapabilities(
        cpu_decode=on_cpu and cpu_decode.KERNEL.available,
        cpu_prefill=on_cpu and cpu_prefill.KERNEL.available,
        cpu_lora=on_cpu and cpu_lora.KERNEL.available,
        cpu_layer_ops=on_cpu and cpu_layer_ops.KERNEL.available,
        cpu_decoder=on_cpu and cpu_decoder.KERNEL.available,
        bf16_gemm=on_cpu and bf16_gemm.KERNEL.available,
        avx2_gemm=on_cpu and avx2_gemm.KERNEL.available,
        vnni_gemm=on_cpu and vnni_gemm.KERNEL.available,
        torch_int4=int4.torch_has_int4_cpu_kernel(),
        native_bf16=on_cpu and bool(native_bfloat16_flags()),
        int4_pack_block=int4.probe_pack_block_n(),
    )
    if not on_cpu or weight_shape is None:
        return kernels
    if dtype == torch.bfloat16:
        weight = torch.randn(weight_shape, dtype=torch.bfloat16)
        kernels = replace(kernels, gemm=choose_bfloat16_gemm(weight, bfloat16_kernel(kernels)))
    elif dtype == torch.float32 and kernels.avx2_gemm:
        kernels = replace(kernels, gemm=choose_float32_gemm(torch.randn(weight_shape)))
    return kernels


def bfloat16_kernel(kernels: KernelCapabilities) -> str | None:
    """The few-row bfloat16 C kernel built here (a key of ``linear.BFLOAT16_KERNELS``): the
    AVX-512 one, else the AVX2 one; None where neither is."""
    if kernels.bf16_gemm:
        return "bf16_gemm"
    return "avx2_gemm" if kernels.avx2_gemm else None


def choose_float32_gemm(weight: torch.Tensor) -> GemmChoice:
    """This CPU's faster float32 GEMMs for decode rows: ``avx2_gemm`` where it outruns torch at
    ``FLOAT32_KERNEL_MAX_ROWS`` rows of ``weight`` (a 2-core AVX2 EPYC: 1.35x; its lead grows as
    the rows fall), else torch."""
    speedup = linear.probe_float32_kernel(weight)
    kernel = speedup >= linear.FLOAT32_KERNEL_MIN_SPEEDUP
    logger.info(
        "float32 GEMMs on this CPU: the C kernel runs %d rows %.2fx as fast, so GEMMs of up to"
        " %d rows %s",
        linear.FLOAT32_KERNEL_MAX_ROWS, speedup, linear.FLOAT32_KERNEL_MAX_ROWS,
        "run in it" if kernel else "stay in torch",
    )  # fmt: skip
    return GemmChoice(float32_kernel_max_rows=linear.FLOAT32_KERNEL_MAX_ROWS if kernel else None)


def choose_bfloat16_gemm(weight: torch.Tensor, kernel_name: str | None) -> GemmChoice:
    """This CPU's faster bfloat16 GEMMs: a C kernel (``kernel_name``, None where none is built)
    for decode rows, float32 for prefill rows.

    Measured on ``weight``, so that the choice follows the CPU (this project's Intel Xeon
    without AMX: the AVX-512 kernel ~1.7x as fast at 16 rows, float32 1.3-1.6x at prefill sizes;
    a Zen 4 EPYC, where the kernel multiplies with AVX-512 BF16's dot product: the kernel ahead
    up to 64 or 128 rows, oneDNN's bfloat16 level from 256 and at prefill sizes; where oneDNN's
    bfloat16 GEMM is the faster throughout, as with AMX, it stays).
    """
    if kernel_name is not None:
        kernel_max_rows, kernel_says = bfloat16_kernel_rows(weight, kernel_name)
        says = [kernel_says]
    else:
        kernel_max_rows, says = None, ["no C kernel (it needs AVX2 or AVX-512, and a C compiler)"]
    upcast_speedup = linear.probe_bfloat16_upcast(weight)
    upcast = upcast_speedup >= linear.BFLOAT16_UPCAST_MIN_SPEEDUP
    says.append(
        f"float32 runs {linear.BFLOAT16_UPCAST_PROBE_ROWS} rows {upcast_speedup:.2f}x as"
        f" fast, so larger GEMMs of {linear.BFLOAT16_UPCAST_MIN_ROWS}+ rows"
        + (" run in float32" if upcast else " stay in bfloat16")
    )
    logger.info("bfloat16 GEMMs on this CPU: %s", "; ".join(says))
    return GemmChoice(
        bfloat16_kernel_max_rows=kernel_max_rows,
        bfloat16_upcast_min_rows=linear.BFLOAT16_UPCAST_MIN_ROWS if upcast else None,
        bfloat16_kernel=kernel_name or "bf16_gemm",
    )


def bfloat16_kernel_rows(weight: torch.Tensor, kernel_name: str) -> tuple[int | None, str]:
    """Up to how many rows the C kernel ``kernel_name`` runs bfloat16 GEMMs (None: never), and
    what the probe measured: it climbs ``BFLOAT16_KERNEL_PROBE_ROWS`` on streamed copies of
    ``weight`` until the kernel no longer wins by ``BFLOAT16_KERNEL_MIN_SPEEDUP``."""
    weights = linear.streamed(weight)
    max_rows, measured = None, []
    for rows in linear.BFLOAT16_KERNEL_PROBE_ROWS:
        speedup = linear.probe_bfloat16_kernel(weights, kernel_name, rows)
        measured.append(f"{rows} rows {speedup:.2f}x")
        if speedup < linear.BFLOAT16_KERNEL_MIN_SPEEDUP:
            break
        max_rows = rows
    verdict = "stay in torch" if max_rows is None else f"of up to {max_rows} rows run in it"
    return (
        max_rows,
        f"the C kernel ({kernel_name}) runs {', '.join(measured)} as fast, so GEMMs {verdict}",
    )
