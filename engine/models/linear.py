"""Linear layers that pick the faster GEMM for the rows at hand on CPU.

Four choices, each exact up to summation order:

- float32, up to ``FLOAT32_KERNEL_MAX_ROWS`` rows: the C kernel of ``avx2_gemm`` on CPUs where it
  outruns torch (``probe_float32_kernel``, once per engine: :class:`GemmChoice`).
- float32, few rows otherwise: ``W·xᵀ`` instead of ``x·Wᵀ`` (``CPU_TRANSPOSED_MAX_ROWS``).
- bfloat16, up to ``BFLOAT16_KERNEL_MAX_ROWS`` rows: a C kernel that reads the bfloat16 weight and
  multiplies in float32 (``bf16_gemm`` on AVX-512, or its widened way where that is the faster;
  ``avx2_gemm`` on AVX2), on CPUs where it outruns oneDNN (``probe_bfloat16_kernel``).
- bfloat16, more rows: the GEMM in float32 on the upcast operands, on CPUs whose float32 GEMM
  outruns their bfloat16 one (``probe_bfloat16_upcast``). A product of two bfloat16 values is
  exact in float32 and oneDNN's bfloat16 GEMM accumulates in float32 too, so only the
  summation order differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmpool.engine.kernels import avx2_gemm, bf16_gemm

if TYPE_CHECKING:  # the capabilities hold a GemmChoice
    from llmpool.engine.kernels.capabilities import KernelCapabilities

# Up to this many rows, W·xᵀ beats x·Wᵀ in float32 on CPU (MKL on 2 threads, SmolLM2's layer
# shapes: 1.9x at 16 rows, 1.1x at 64, slower from about 96 rows, where prefill batches live).
# bfloat16 goes through oneDNN, where the plain orientation is already the faster one.
CPU_TRANSPOSED_MAX_ROWS = 64

# From this many rows a bfloat16 GEMM is compute-bound, and where the CPU multiplies bfloat16 no
# faster than float32 (AVX-512 BF16 without AMX on Intel: one bfloat16 dot-product port), the
# float32 GEMM on upcast operands wins despite the weight's conversion: on this project's
# 2-core Xeon 1.3x at 128 rows and 1.6x at 256 on SmolLM2's shapes, 0.6x at 16 (decode rows,
# where reading the weight dominates and bfloat16 reads half as much).
BFLOAT16_UPCAST_MIN_ROWS = 128
# The probe asks whether the CPU's float32 GEMM is the faster one at a compute-bound size, with
# a margin, so that noise cannot flip the choice (1.3-1.6x here from 128 rows up).
BFLOAT16_UPCAST_PROBE_ROWS = 256
BFLOAT16_UPCAST_MIN_SPEEDUP = 1.2

# Up to this many rows the C kernel can run a step's GEMMs at least as fast as the float32
# upcast (the Xeon: 1.5x at 64 rows, 1.03x at 128, 0.87x at 256; benchmarks/bf16_gemm.py).
# Where it stops beating torch depends on the CPU (a Zen 4 EPYC, whose oneDNN multiplies
# bfloat16 natively, as the kernel does there with vdpbf16ps: 2.1x at 16 rows, 1.45x at 64,
# 1.18x at 128, 1.04x at 256; an Intel Xeon with AMX, both on AMX tiles: 1.83x at 16, 1.43x at
# 64, 1.18x at 128, 1.02x at 256), so the probe climbs these row counts and the kernel takes
# GEMMs up to the last one it won by BFLOAT16_KERNEL_MIN_SPEEDUP.
BFLOAT16_KERNEL_MAX_ROWS = 128
BFLOAT16_KERNEL_PROBE_ROWS = (8, 16, 32, 64, BFLOAT16_KERNEL_MAX_ROWS)
BFLOAT16_KERNEL_MIN_SPEEDUP = 1.1
# Where the C decoder is built (``cpu_decoder``), a decode step of up to this many requests runs
# in one C call, which saves the step's per-layer dispatch: there the kernel also takes GEMMs of
# up to this many rows while it keeps BFLOAT16_DECODER_MIN_SPEEDUP of torch's rate. An Intel Xeon
# with AMX, whose oneDNN GEMM outruns the kernel's vdpbf16ps build (the kernel without AMX
# tiles, as where Linux refuses them) from 16 rows (the probe: 0.67-0.91x there), decodes 9, 12
# and 16 requests 1.49x, 1.46x and 1.23x as fast that way as layer by layer (32 with the kernel
# up to 32 rows, 0.57x at 32: 0.91x, so no further).
BFLOAT16_DECODER_ROWS = 16
BFLOAT16_DECODER_MIN_SPEEDUP = 0.6
# The few-row probes stream their weight from memory as a step does: copies of it totalling at
# least this much, twice a 2-core EPYC's last-level cache, are multiplied in turn. A probe on one
# weight that stays in cache answers another question: on that EPYC it put the AVX-512 kernel at
# 0.84x of oneDNN at 16 rows, while a step's GEMMs, whose weights stream, ran 1.18x as fast in it.
PROBE_STREAM_BYTES = 64 * 1024**2
# The few-row bfloat16 kernels by name (``GemmChoice.bfloat16_kernel``): the AVX-512 one, its
# widened way (the weight widened to float32 in tiles at every row count), and the AVX2 one for
# CPUs without AVX-512.
BFLOAT16_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "bf16_gemm": bf16_gemm.linear,
    "bf16_gemm_widened": bf16_gemm.widened_linear,
    "avx2_gemm": avx2_gemm.bf16_op,
}
# The widened way replaces the AVX-512 kernel's own where it multiplies this many rows (compute-
# bound) BFLOAT16_KERNEL_MIN_SPEEDUP as fast, and one row (bound by reading the weight: a single
# request's decode) at least BFLOAT16_WIDENED_MIN_ONE_ROW as fast. A 2-core Intel Xeon with AVX-512
# BF16 and no AMX, whose vdpbf16ps has half its FMAs' flop rate: 1.31x at 32 rows (1.38x at 64),
# 1.27x at 1. 32 rows, not more: the probe runs beside the others at every start (0.14 s here).
BFLOAT16_WIDENED_PROBE_ROWS = 32
BFLOAT16_WIDENED_MIN_ONE_ROW = 0.95

# Up to this many rows ``avx2_gemm``'s float32 kernel runs a step's GEMMs faster than torch where
# it is chosen (a 2-core AVX2 EPYC, a step's GEMMs of SmolLM2: 2.2x at 1 row, 1.5x at 4, 1.35x
# at 16, 1.05x at 64; benchmarks/avx2_gemm.py); its probe asks about the largest of them.
FLOAT32_KERNEL_MAX_ROWS = 16
FLOAT32_KERNEL_MIN_SPEEDUP = 1.1


@dataclass(frozen=True)
class GemmChoice:
    """Which GEMMs run where on this CPU, probed once per engine (``kernels.capabilities``) and
    held by every layer that calls :func:`linear`; the default is torch's own GEMMs throughout.

    ``bfloat16_kernel_max_rows``: bfloat16 GEMMs of at most this many rows run in the C kernel
    named by ``bfloat16_kernel`` (a key of ``BFLOAT16_KERNELS``; None: never).
    ``bfloat16_upcast_min_rows``: bfloat16 GEMMs of at least this many rows run in float32 on the
    upcast operands (None: never). ``float32_kernel_max_rows``: float32 GEMMs of at most this
    many rows run in ``avx2_gemm`` (None: never).
    """

    bfloat16_kernel_max_rows: int | None = None
    bfloat16_upcast_min_rows: int | None = None
    bfloat16_kernel: str = "bf16_gemm"
    float32_kernel_max_rows: int | None = None

    def as_observed(self) -> dict[str, str | int | None]:
        """The choice as ``/fingerprint`` reports it (``observed.gemm``): the probes time the
        CPU at start, so two replicas of one pool may choose differently (another CPU, or a
        neighbour that slowed a probe), and the kernels round differently: a greedy answer can
        differ between them."""
        bfloat16_kernel = (
            self.bfloat16_kernel if self.bfloat16_kernel_max_rows is not None else None
        )
        return {
            "bfloat16Kernel": bfloat16_kernel,
            "bfloat16KernelMaxRows": self.bfloat16_kernel_max_rows,
            "bfloat16UpcastMinRows": self.bfloat16_upcast_min_rows,
            "float32KernelMaxRows": self.float32_kernel_max_rows,
        }


TORCH_GEMMS = GemmChoice()


def _speedup(native: Callable[[], object], candidate: Callable[[], object], repeats: int) -> float:
    """How many times faster ``candidate`` runs than ``native``: the fastest of ``repeats``
    interleaved runs of each, the first pair dropped as warm-up.

    The fastest run, not the median: pods start beside busy neighbours, and a run that shares
    its cores is slower by however long it waited, which says nothing about the GEMM (on a
    2-core EPYC with two other servers starting, the median ratio put the AVX2 bfloat16 kernel
    at 0.90x of torch; idle, it is 6.6x)."""
    native_seconds: list[float] = []
    candidate_seconds: list[float] = []
    with torch.inference_mode():
        for _ in range(repeats):
            for run, seconds in ((native, native_seconds), (candidate, candidate_seconds)):
                started = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - started)
    return min(native_seconds[1:]) / min(candidate_seconds[1:])


def streamed(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` and copies of it, ``PROBE_STREAM_BYTES`` in all, for a probe to multiply in
    turn so that each GEMM reads its weight from memory, not from cache."""
    size = weight.numel() * weight.element_size()
    return [weight, *(weight.clone() for _ in range(-(-PROBE_STREAM_BYTES // size) - 1))]


def probe_bfloat16_upcast(
    weight: torch.Tensor, rows: int = BFLOAT16_UPCAST_PROBE_ROWS, repeats: int = 7
) -> float:
    """How many times faster ``rows`` rows against the bfloat16 ``weight`` run upcast to
    float32 than in bfloat16 on this CPU, the conversions counted.
    """
    x = torch.randn(rows, weight.shape[1], dtype=torch.bfloat16)
    return _speedup(
        lambda: nn.functional.linear(x, weight), lambda: _upcast_linear(x, weight, None), repeats
    )


def probe_bfloat16_kernel(
    weights: list[torch.Tensor],
    kernel: str,
    rows: int,
    repeats: int = 5,
    against: str | None = None,
) -> float:
    """How many times faster the C kernel ``kernel`` (a key of ``BFLOAT16_KERNELS``) multiplies
    ``rows`` rows by each of the bfloat16 ``weights`` (:func:`streamed`) than torch does on this
    CPU, or than the kernel ``against``."""
    x = torch.randn(rows, weights[0].shape[1], dtype=torch.bfloat16)
    run = BFLOAT16_KERNELS[kernel]
    native = nn.functional.linear if against is None else BFLOAT16_KERNELS[against]
    return _speedup(
        lambda: [native(x, w) for w in weights],
        lambda: [run(x, w) for w in weights],
        repeats,
    )


def probe_float32_kernel(
    weight: torch.Tensor, rows: int = FLOAT32_KERNEL_MAX_ROWS, repeats: int = 7
) -> float:
    """How many times faster ``avx2_gemm`` multiplies ``rows`` rows by the float32 ``weight``
    (streamed) than torch's float32 path of :func:`linear` does on this CPU."""
    weights = streamed(weight)
    x = torch.randn(rows, weight.shape[1])
    return _speedup(
        lambda: [linear(x, w) for w in weights],
        lambda: [avx2_gemm.f32_linear(x, w) for w in weights],
        repeats,
    )


def _upcast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out = nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemm: GemmChoice = TORCH_GEMMS,
) -> torch.Tensor:
    """``x @ weight.T + bias``, on CPU as ``gemm`` says.

    Decode batches are a few rows against a large weight. On one thread both orientations take
    the same time; on two, MKL's split of x·Wᵀ with few rows barely gains, while W·xᵀ has the
    weight's many rows to split, so each thread streams half of the weight.
    """
    if x.device.type != "cpu" or x.dim() != 2:
        return nn.functional.linear(x, weight, bias)
    if x.dtype == torch.bfloat16:
        max_rows = gemm.bfloat16_kernel_max_rows
        if max_rows is not None and x.shape[0] <= max_rows:
            out = BFLOAT16_KERNELS[gemm.bfloat16_kernel](x, weight)
            return out if bias is None else out + bias
        min_rows = gemm.bfloat16_upcast_min_rows
        if min_rows is not None and x.shape[0] >= min_rows:
            return _upcast_linear(x, weight, bias)
        return nn.functional.linear(x, weight, bias)
    if x.dtype != torch.float32 or x.shape[0] > CPU_TRANSPOSED_MAX_ROWS:
        return nn.functional.linear(x, weight, bias)
    max_rows = gemm.float32_kernel_max_rows
    if max_rows is not None and x.shape[0] <= max_rows:
        out = avx2_gemm.f32_op(x, weight)
    else:
        out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """``nn.Linear`` computed by :func:`linear`, with the engine's :class:`GemmChoice` (a plain
    attribute fixed at construction, which a compiled forward reads without tracing a probe)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, gemm: GemmChoice = TORCH_GEMMS
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.gemm = gemm

    def use_kernels(self, kernels: KernelCapabilities) -> None:
        self.gemm = kernels.gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.gemm)
