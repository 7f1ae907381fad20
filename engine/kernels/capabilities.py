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
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

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
    cpu_share,
    sampling,
    vnni_gemm,
)
from llmpool.engine.models import int4, linear
from llmpool.engine.models.linear import TORCH_GEMMS, GemmChoice

if TYPE_CHECKING:
    from llmpool.engine.gemm_store import GemmStore

logger = logging.getLogger(__name__)

# The GEMM probes run again, after a pause, while other processes used more than this share of
# the CPUs as they ran (``cpu_share``): an idle machine's background is 0-2%, a node's kubelet
# and control plane use more but steadily, while neighbours starting (or spinning) take 50% and
# more of a 2-core machine.
PROBE_NEIGHBOUR_SHARE_MAX = 0.25
# For at most this long; then the least disturbed run's choice stands, logged as a warning and
# reported by /fingerprint. A start waits this long only beside busy neighbours, while a wrong
# choice costs every step for the engine's life (2.6x a token, in the case ``cpu_share`` tells).
PROBE_PATIENCE_S = 15.0
# A random pause, so that replicas starting together stop probing in step: this many times the
# disturbed run's own duration (at least a second's), so that a longer probe (bfloat16's, ~1.5 s
# on a 2-core Xeon since it also weighs the widened kernel) keeps its neighbours' runs as far
# apart as a short one (three engines probing at once settled no more with fixed 0.5-2 s pauses).
PROBE_PAUSE_S = (0.5, 2.0)

Choice = tuple[GemmChoice, str]  # a GEMM choice and what its probes measured, in words


@dataclass(frozen=True)
class GemmProbe:
    """How the GEMM probes ran: how many times (``attempts``), and the share of the CPUs that
    other processes used during the run whose choice stands (None: ``/proc/stat`` unreadable);
    ``stored``: they ran at an earlier start, whose choice this one read (``GemmStore``)."""

    attempts: int
    neighbour_share: float | None
    stored: bool = False

    @property
    def settled(self) -> bool:
        """The chosen run had the CPUs to itself (as far as ``/proc/stat`` tells)."""
        share = self.neighbour_share
        return share is None or share <= PROBE_NEIGHBOUR_SHARE_MAX

    def as_observed(self) -> dict[str, int | float | bool | None]:
        share = self.neighbour_share
        return {
            "attempts": self.attempts,
            "neighbourShare": None if share is None else round(share, 3),
            "stored": self.stored,
        }


class GemmDecision(NamedTuple):
    """A GEMM choice, what its probes measured (in words) and how they ran."""

    gemm: GemmChoice
    says: str
    probe: GemmProbe


@dataclass(frozen=True)
class KernelCapabilities:
    """Which kernels an engine runs; the defaults are torch alone (no C kernel built)."""

    cpu_decode: bool = False  # cpu_decode.c: the CPU attention backend's decodes
    cpu_prefill: bool = False  # cpu_prefill.c: its multi-token queries (AVX2 or AVX-512)
    cpu_lora: bool = False  # cpu_lora.c: the CPU backend's adapter deltas
    cpu_layer_ops: bool = False  # cpu_layer_ops.c: the CPU backend's norms and rotary
    cpu_decoder: bool = False  # cpu_decoder.c: decode steps' layers in one call (those kernels')
    sampling: bool = False  # sampling.c: argmax, top-k and top-p (logits are sampled on the CPU)
    bf16_gemm: bool = False  # bf16_gemm.c is built (AVX-512); whether it runs: ``gemm``
    avx2_gemm: bool = False  # avx2_gemm.c is built (AVX2 and FMA); whether it runs: ``gemm``
    vnni_gemm: bool = False  # vnni_gemm.c: int8 decodes, int4 GEMMs (AVX-512 VNNI and VBMI)
    torch_int4: bool = False  # torch's own packed int4 CPU kernel exists
    # The CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX), so torch's bfloat16 GEMM runs at
    # its full rate: large int4 batches dequantize to it, from this many rows
    # (int4.dequantized_min_rows: later where vnni_gemm's int4 rows run on AMX tiles).
    native_bf16: bool = False
    int4_dequantized_min_rows: int = int4.INT4_DEQUANTIZED_MIN_ROWS
    int4_pack_block: int = int4.INT4_OUT_MULTIPLE  # output block of torch's int4 layout
    gemm: GemmChoice = TORCH_GEMMS  # which GEMMs run where
    # How its probes ran (None: nothing was probed): a report, not a capability, so it stays
    # out of equality and of the repr that keys the compile cache (engine_builder).
    gemm_probe: GemmProbe | None = field(default=None, compare=False, repr=False)


def probe_kernels(
    device: torch.device,
    dtype: torch.dtype | None = None,
    weight_shape: tuple[int, int] | None = None,
    store: GemmStore | None = None,
    patience_s: float | None = None,
) -> KernelCapabilities:
    """The capabilities of an engine on ``device``: on CPU the C kernels are built (or found in
    the cache) now. For a float32 or bfloat16 model on CPU, ``weight_shape`` (the widest dense
    projection; None for quantized layers, which have their own kernels) is the GEMM the choices
    of ``gemm`` are measured on, unless ``store`` holds the choice of an earlier start; the
    probes wait up to ``patience_s`` (None: ``PROBE_PATIENCE_S``) for quiet CPUs."""
    on_cpu = device.type == "cpu"
    kernels = KernelCapabilities(
        cpu_decode=on_cpu and cpu_decode.KERNEL.available,
        cpu_prefill=on_cpu and cpu_prefill.KERNEL.available,
        cpu_lora=on_cpu and cpu_lora.KERNEL.available,
        cpu_layer_ops=on_cpu and cpu_layer_ops.KERNEL.available,
        cpu_decoder=on_cpu and cpu_decoder.KERNEL.available,
        sampling=sampling.KERNEL.available,
        bf16_gemm=on_cpu and bf16_gemm.KERNEL.available,
        avx2_gemm=on_cpu and avx2_gemm.KERNEL.available,
        vnni_gemm=on_cpu and vnni_gemm.KERNEL.available,
        torch_int4=int4.torch_has_int4_cpu_kernel(),
        native_bf16=on_cpu and bool(native_bfloat16_flags()),
        int4_dequantized_min_rows=int4.dequantized_min_rows(
            on_cpu and vnni_gemm.KERNEL.available and vnni_gemm.int4_tiles()
        ),
        int4_pack_block=int4.probe_pack_block_n(),
    )
    if not on_cpu or weight_shape is None:
        return kernels
    if dtype == torch.bfloat16:
        names = bfloat16_kernels(kernels)

        def choose() -> Choice:
            weight = torch.randn(weight_shape, dtype=torch.bfloat16)
            return choose_bfloat16_gemm(weight, names, decodes_in_c(kernels))
    elif dtype == torch.float32 and kernels.avx2_gemm:

        def choose() -> Choice:
            return choose_float32_gemm(torch.randn(weight_shape))
    else:
        return kernels
    decision = stored_or_probed(choose, store, kernels, patience_s)
    return replace(kernels, gemm=decision.gemm, gemm_probe=decision.probe)


def stored_or_probed(
    choose: Callable[[], Choice],
    store: GemmStore | None,
    kernels: KernelCapabilities,
    patience_s: float | None = None,
) -> GemmDecision:
    """The choice ``store`` holds where it names kernels built here; else ``choose``'s, probed
    now (:func:`undisturbed`) and published to ``store`` where the run was settled. A choice
    another start published first stands instead, also over a run never settled (whose probes
    stop as soon as one is stored)."""
    if store is not None and (stored := store.load()) is not None:
        if runs_here(stored.gemm, kernels):
            logger.info(
                "%s; the probes ran %s at an earlier start, which stored the choice at %s"
                " (delete it to probe again)",
                stored.says, describe(stored.probe), store.path,
            )  # fmt: skip
            return stored
        store.discard(f"it names a kernel not built here ({stored.gemm})")
    (gemm, says), probe = undisturbed(
        choose,
        stored_meanwhile=None if store is None else lambda: stored_here(store, kernels),
        patience_s=patience_s,
    )
    logger.info("%s; the probes ran %s", says, describe(probe))
    decision = GemmDecision(gemm, says, probe)
    if store is None:
        return decision
    # Unsettled, this start's choice is worse than a settled one another start stored meanwhile.
    taken = store.publish(decision) if probe.settled else stored_here(store, kernels) or decision
    if taken is decision or not runs_here(taken.gemm, kernels):
        return decision
    logger.info(
        "another start stored its GEMM choice at %s first; this one takes it, so that both run"
        " (and compile) the same GEMMs: %s",
        store.path, taken.says,
    )  # fmt: skip
    return taken


def stored_here(store: GemmStore, kernels: KernelCapabilities) -> GemmDecision | None:
    """The choice ``store`` holds now, where it names kernels built here."""
    stored = store.load()
    return stored if stored is not None and runs_here(stored.gemm, kernels) else None


def runs_here(gemm: GemmChoice, kernels: KernelCapabilities) -> bool:
    """Whether every C kernel ``gemm`` chooses is built here."""
    return (
        gemm.bfloat16_kernel_max_rows is None or gemm.bfloat16_kernel in bfloat16_kernels(kernels)
    ) and (gemm.float32_kernel_max_rows is None or kernels.avx2_gemm)


def undisturbed(
    probe: Callable[[], Choice],
    stored_meanwhile: Callable[[], GemmDecision | None] | None = None,
    patience_s: float | None = None,
) -> tuple[Choice, GemmProbe]:
    """``probe()``'s answer from a run that had the CPUs to itself: it runs again after a random
    pause (``PROBE_PAUSE_S``) while other processes used more than ``PROBE_NEIGHBOUR_SHARE_MAX``
    of the CPUs, for up to ``patience_s`` (None: ``PROBE_PATIENCE_S``; 0: one run); past that
    the least disturbed run's answer stands, with a warning. It stands at once where
    ``stored_meanwhile()`` finds a choice another start stored (replicas starting together):
    the caller takes that one instead."""
    patience_s = PROBE_PATIENCE_S if patience_s is None else patience_s
    deadline = time.monotonic() + patience_s
    runs: list[tuple[float, Choice]] = []
    while True:
        started = time.monotonic()
        answer, share = cpu_share.neighbour_share(probe)
        ran = time.monotonic() - started
        if share is None or share <= PROBE_NEIGHBOUR_SHARE_MAX:
            return answer, GemmProbe(len(runs) + 1, share)
        runs.append((share, answer))
        if stored_meanwhile is not None and stored_meanwhile():
            logger.info(
                "GEMM probe %d: other processes used %.0f%% of the CPUs while it ran; another"
                " start stored its choice meanwhile, so this one probes no more",
                len(runs), 100 * share,
            )  # fmt: skip
            return least_disturbed(runs)
        if time.monotonic() >= deadline:
            break
        logger.info(
            "GEMM probe %d: other processes used %.0f%% of the CPUs while it ran; probing again",
            len(runs), 100 * share,
        )  # fmt: skip
        time.sleep(random.uniform(*PROBE_PAUSE_S) * max(ran, 1.0))
    answer, probe_run = least_disturbed(runs)
    logger.warning(
        "the GEMM probes shared the CPUs with other processes for %.0f s (%s): the choice below"
        " may not be this CPU's; a restart on a quieter node probes again",
        patience_s, describe(probe_run),
    )  # fmt: skip
    return answer, probe_run


def least_disturbed(runs: list[tuple[float, Choice]]) -> tuple[Choice, GemmProbe]:
    """The answer of the run that other processes disturbed least, of ``runs`` (share, answer)."""
    share, answer = min(runs, key=lambda run: run[0])
    return answer, GemmProbe(len(runs), share)


def describe(probe: GemmProbe) -> str:
    """How the probes ran, in words, for the start-up log."""
    share = (
        "unknown"
        if probe.neighbour_share is None
        else f"{100 * probe.neighbour_share:.0f}% of the CPUs used by other processes"
    )
    return f"{probe.attempts} time{'s' * (probe.attempts > 1)}, the chosen run with {share}"


def bfloat16_kernels(kernels: KernelCapabilities) -> tuple[str, ...]:
    """The few-row bfloat16 C kernels built here (keys of ``linear.BFLOAT16_KERNELS``), the
    build's own way first: the AVX-512 one and its widened way, else the AVX2 one."""
    if kernels.bf16_gemm:
        return ("bf16_gemm", "bf16_gemm_widened")
    return ("avx2_gemm",) if kernels.avx2_gemm else ()


def bfloat16_kernel(kernels: KernelCapabilities) -> str | None:
    """The few-row bfloat16 C kernel built here in its build's own way; None where none is."""
    return next(iter(bfloat16_kernels(kernels)), None)


def choose_float32_gemm(weight: torch.Tensor) -> Choice:
    """This CPU's faster float32 GEMMs for decode rows: ``avx2_gemm`` where it outruns torch at
    ``FLOAT32_KERNEL_MAX_ROWS`` rows of ``weight`` (a 2-core AVX2 EPYC: 1.35x; its lead grows as
    the rows fall), else torch."""
    speedup = linear.probe_float32_kernel(weight)
    kernel = speedup >= linear.FLOAT32_KERNEL_MIN_SPEEDUP
    rows = linear.FLOAT32_KERNEL_MAX_ROWS
    says = (
        f"float32 GEMMs on this CPU: the C kernel runs {rows} rows {speedup:.2f}x as fast, so"
        f" GEMMs of up to {rows} rows {'run in it' if kernel else 'stay in torch'}"
    )
    return GemmChoice(float32_kernel_max_rows=rows if kernel else None), says


def decodes_in_c(kernels: KernelCapabilities) -> bool:
    """Whether the C decoder is built here (``cpu_decoder.for_model`` says whether it runs)."""
    return kernels.cpu_decoder and kernels.cpu_decode and kernels.cpu_layer_ops


def choose_bfloat16_gemm(
    weight: torch.Tensor, kernel_names: Sequence[str], in_c_decoder: bool = False
) -> Choice:
    """This CPU's faster bfloat16 GEMMs: a C kernel (one of ``kernel_names``, those built here:
    :func:`bfloat16_kernels`) for decode rows, float32 for prefill rows.

    Measured on ``weight``, so that the choice follows the CPU (this project's Intel Xeon
    without AMX: the AVX-512 kernel ~1.7x as fast at 16 rows, float32 1.3-1.6x at prefill sizes;
    a Zen 4 EPYC, where the kernel multiplies with AVX-512 BF16's dot product: the kernel ahead
    up to 64 or 128 rows, oneDNN's bfloat16 level from 256 and at prefill sizes; an Intel Xeon
    with AMX, where both multiply on AMX tiles: the kernel up to 128 rows; its vdpbf16ps build
    there up to 16 rows, as its decode steps run in the C decoder, though oneDNN's GEMM alone is
    the faster from 16).
    """
    kernel_name = None
    if kernel_names:
        weights = linear.streamed(weight)  # 64 MiB of copies, made once for both probes
        kernel_name, chosen_says = choose_bfloat16_kernel(weights, kernel_names)
        kernel_max_rows, kernel_says = bfloat16_kernel_rows(weights, kernel_name, in_c_decoder)
        says = [*chosen_says, kernel_says]
    else:
        kernel_max_rows, says = None, ["no C kernel (it needs AVX2 or AVX-512, and a C compiler)"]
    upcast_speedup = linear.probe_bfloat16_upcast(weight)
    upcast = upcast_speedup >= linear.BFLOAT16_UPCAST_MIN_SPEEDUP
    says.append(
        f"float32 runs {linear.BFLOAT16_UPCAST_PROBE_ROWS} rows {upcast_speedup:.2f}x as"
        f" fast, so larger GEMMs of {linear.BFLOAT16_UPCAST_MIN_ROWS}+ rows"
        + (" run in float32" if upcast else " stay in bfloat16")
    )
    choice = GemmChoice(
        bfloat16_kernel_max_rows=kernel_max_rows,
        bfloat16_upcast_min_rows=linear.BFLOAT16_UPCAST_MIN_ROWS if upcast else None,
        bfloat16_kernel=kernel_name or "bf16_gemm",
    )
    return choice, f"bfloat16 GEMMs on this CPU: {'; '.join(says)}"


def choose_bfloat16_kernel(
    weights: list[torch.Tensor], kernel_names: Sequence[str]
) -> tuple[str, list[str]]:
    """Which of the C kernels ``kernel_names`` (the build's own way first, then at most its
    widened way) multiplies this CPU's bfloat16 GEMMs, and what the probe measured: the widened
    way where, on ``weights`` (a weight's streamed copies: :func:`linear.streamed`), it runs
    ``BFLOAT16_WIDENED_PROBE_ROWS`` rows ``BFLOAT16_KERNEL_MIN_SPEEDUP`` as fast and one row
    ``BFLOAT16_WIDENED_MIN_ONE_ROW`` as fast (an Intel Xeon with AVX-512 BF16 and no AMX: 1.31x
    and 1.27x; a Zen 4 EPYC and an AMX Xeon, whose dot product and tiles double the FMAs' rate,
    keep their own way)."""
    own, *others = kernel_names
    if not others:
        return own, []
    (widened,) = others
    rows = linear.BFLOAT16_WIDENED_PROBE_ROWS
    at_rows = linear.probe_bfloat16_kernel(weights, widened, rows, against=own)
    at_one = linear.probe_bfloat16_kernel(weights, widened, 1, against=own)
    faster = (
        at_rows >= linear.BFLOAT16_KERNEL_MIN_SPEEDUP
        and at_one >= linear.BFLOAT16_WIDENED_MIN_ONE_ROW
    )
    chosen = widened if faster else own
    return chosen, [
        f"{widened} runs {rows} rows {at_rows:.2f}x and 1 row {at_one:.2f}x as fast as {own},"
        f" so {chosen} runs them"
    ]


def bfloat16_kernel_rows(
    weights: list[torch.Tensor], kernel_name: str, in_c_decoder: bool = False
) -> tuple[int | None, str]:
    """Up to how many rows the C kernel ``kernel_name`` runs bfloat16 GEMMs (None: never), and
    what the probe measured: it climbs ``BFLOAT16_KERNEL_PROBE_ROWS`` on ``weights`` (streamed
    copies) until the kernel no longer wins by ``BFLOAT16_KERNEL_MIN_SPEEDUP``; where decode
    steps run in the C decoder (``in_c_decoder``), up to ``BFLOAT16_DECODER_ROWS`` rows it need
    only keep ``BFLOAT16_DECODER_MIN_SPEEDUP`` of torch's rate."""
    max_rows, measured = None, []
    for rows in linear.BFLOAT16_KERNEL_PROBE_ROWS:
        speedup = linear.probe_bfloat16_kernel(weights, kernel_name, rows)
        measured.append(f"{rows} rows {speedup:.2f}x")
        in_one_call = in_c_decoder and rows <= linear.BFLOAT16_DECODER_ROWS
        bar = (
            linear.BFLOAT16_DECODER_MIN_SPEEDUP
            if in_one_call
            else linear.BFLOAT16_KERNEL_MIN_SPEEDUP
        )
        if speedup < bar:
            break
        max_rows = rows
    verdict = "stay in torch" if max_rows is None else f"of up to {max_rows} rows run in it"
    if in_c_decoder:
        verdict += (
            f" (a decode step of up to {linear.BFLOAT16_DECODER_ROWS} rows runs in one C call,"
            f" so there {linear.BFLOAT16_DECODER_MIN_SPEEDUP}x suffices)"
        )
    return (
        max_rows,
        f"the C kernel ({kernel_name}) runs {', '.join(measured)} as fast, so GEMMs {verdict}",
    )
