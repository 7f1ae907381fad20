"""What this engine's kernels can do here, probed once per engine and passed down.

The C kernels build or not with the machine (a compiler, AVX-512, VNNI), torch's packed int4
layout follows the vector width torch was dispatched for, and whether the bfloat16 C kernel or a
float32 upcast outruns oneDNN is measured. The engine probes all of it once at start
(:func:`probe_kernels`) and gives the result to the backends and layers that choose by it; each
layer keeps what it reads as plain attributes fixed before any forward, so that a compiled
forward reads settled values instead of tracing a probe (which would break its graph).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from llmpool.engine.kernels import bf16_gemm, cpu_decode, cpu_lora, vnni_gemm
from llmpool.engine.models import int4, linear
from llmpool.engine.models.linear import TORCH_GEMMS, GemmChoice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelCapabilities:
    """Which kernels an engine runs; the defaults are torch alone (no C kernel built)."""

    cpu_decode: bool = False  # cpu_decode.c: the CPU attention backend's decodes
    cpu_lora: bool = False  # cpu_lora.c: the CPU backend's adapter deltas
    bf16_gemm: bool = False  # bf16_gemm.c is built (AVX-512); whether it runs: ``gemm``
    vnni_gemm: bool = False  # vnni_gemm.c: int8 and int4 decodes (AVX-512 VNNI and VBMI)
    torch_int4: bool = False  # torch's own packed int4 CPU kernel exists
    int4_pack_block: int = int4.INT4_OUT_MULTIPLE  # output block of torch's int4 layout
    gemm: GemmChoice = TORCH_GEMMS  # which bfloat16 GEMMs run where


def probe_kernels(
    device: torch.device,
    dtype: torch.dtype | None = None,
    bfloat16_weight_shape: tuple[int, int] | None = None,
) -> KernelCapabilities:
    """The capabilities of an engine on ``device``: on CPU the C kernels are built (or found in
    the cache) now. For a bfloat16 model on CPU, ``bfloat16_weight_shape`` (the widest dense
    projection; None for quantized layers, which have their own kernels) is the GEMM the
    bfloat16 choices are measured on."""
    on_cpu = device.type == "cpu"
    kernels = KernelCapabilities(
        cpu_decode=on_cpu and cpu_decode.KERNEL.available,
        cpu_lora=on_cpu and cpu_lora.KERNEL.available,
        bf16_gemm=on_cpu and bf16_gemm.KERNEL.available,
        vnni_gemm=on_cpu and vnni_gemm.KERNEL.available,
        torch_int4=int4.torch_has_int4_cpu_kernel(),
        int4_pack_block=int4.probe_pack_block_n(),
    )
    if on_cpu and dtype == torch.bfloat16 and bfloat16_weight_shape is not None:
        weight = torch.randn(bfloat16_weight_shape, dtype=torch.bfloat16)
        kernels = replace(kernels, gemm=choose_bfloat16_gemm(weight, kernels.bf16_gemm))
    return kernels


def choose_bfloat16_gemm(weight: torch.Tensor, kernel_built: bool) -> GemmChoice:
    """This CPU's faster bfloat16 GEMMs: the C kernel for decode rows, float32 for prefill rows.

    Measured on ``weight``, so that the choice follows the CPU (this project's Intel Xeon
    without AMX: the kernel ~1.7x as fast at 16 rows, float32 1.3-1.6x at prefill sizes; where
    oneDNN's bfloat16 GEMM is the faster, as with AMX, it stays).
    """
    if kernel_built:
        kernel_speedup = linear.probe_bfloat16_kernel(weight)
        kernel = kernel_speedup >= linear.BFLOAT16_KERNEL_MIN_SPEEDUP
        says = [
            f"the C kernel runs {linear.BFLOAT16_KERNEL_PROBE_ROWS} rows"
            f" {kernel_speedup:.2f}x as fast, so GEMMs of up to"
            f" {linear.BFLOAT16_KERNEL_MAX_ROWS} rows"
            + (" run in it" if kernel else " stay in torch")
        ]
    else:
        kernel, says = False, ["no C kernel (it needs AVX-512 and a C compiler)"]
    upcast_speedup = linear.probe_bfloat16_upcast(weight)
    upcast = upcast_speedup >= linear.BFLOAT16_UPCAST_MIN_SPEEDUP
    says.append(
        f"float32 runs {linear.BFLOAT16_UPCAST_PROBE_ROWS} rows {upcast_speedup:.2f}x as"
        f" fast, so larger GEMMs of {linear.BFLOAT16_UPCAST_MIN_ROWS}+ rows"
        + (" run in float32" if upcast else " stay in bfloat16")
    )
    logger.info("bfloat16 GEMMs on this CPU: %s", "; ".join(says))
    return GemmChoice(
        bfloat16_kernel_max_rows=linear.BFLOAT16_KERNEL_MAX_ROWS if kernel else None,
        bfloat16_upcast_min_rows=linear.BFLOAT16_UPCAST_MIN_ROWS if upcast else None,
    )
