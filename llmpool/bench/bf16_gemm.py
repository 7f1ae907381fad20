"""Few-row bfloat16 GEMMs on CPU: the ``bf16_gemm`` C kernel against torch, and the step.

Two measurements, each alternating between the ways in one process:

- a decode step's GEMMs alone (every layer's four projections and the LM head of the built-in
  model, 269 MB of bfloat16 weights, so they stream from memory as in a step) at ``--rows``
  rows: torch's bfloat16 GEMM (oneDNN), the C kernel as built for this CPU, its widened way
  (``bf16_linear_widened``: the weight widened to float32 in tiles at every row count, which the
  start-up probe may choose instead), the float32 GEMM on upcast operands (what ``linear``
  runs for prefill chunks past the kernel's rows) and the
  kernel's narrower builds this CPU's build passes over (``widening``: the float32 path of CPUs
  without AVX-512 BF16; ``dot product``: the AVX-512 BF16 path of CPUs without AMX); with the
  weight bandwidth and GFLOP/s of each and the largest difference from the float32 product;
- the engine's whole eager bfloat16 step with ``--concurrency`` requests of 40-700-token prompts
  decoding, rounds of steps alternating between the kernel up to the rows its start-up probe
  chose (``probed``) and torch throughout (the choice is one engine: ``kernel_up_to``).

``--against REV`` adds to the first the kernel as it was at git revision ``REV``, built for this
CPU as the current one is (``llmpool.bench.revision``): its ratio ``REV_over_kernel``.

    python benchmarks/bf16_gemm.py --rows 1 4 16 64 128 256 512 --concurrency 1 16 64

Writes ``benchmarks/results/bf16_gemm.json`` (``--name``: another name) with the CPU model.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from llmpool.bench.launch import build_in_ended_thread
from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.revision import kernel_at_revision
from llmpool.bench.steps import alternate_steps, gemm_ms, gemm_weights, layer_by_layer
from llmpool.engine import LLM
from llmpool.engine.kernels import bf16_gemm


def upcast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)


Way = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
WAYS: dict[str, Way] = {
    "torch": torch.nn.functional.linear,
    "kernel": bf16_gemm.bf16_linear,
    "widened": bf16_gemm.bf16_linear_widened,
    "upcast": upcast,
}


def with_narrower_builds(ways: dict[str, Way]) -> dict[str, Way]:
    """``ways`` and each of the kernel's narrower builds that differs from this CPU's."""
    builds = {name: bf16_gemm.narrower_build(name) for name in bf16_gemm.NARROWER_BUILDS}
    return ways | {
        name: functools.partial(bf16_gemm.bf16_linear, library=library)
        for name, library in builds.items()
        if library is not None
    }


def step_gemms(
    weights: list[torch.Tensor],
    rows: int,
    rounds: int,
    ways: dict[str, Way] = WAYS,
) -> dict[str, Any]:
    """A step's GEMMs at ``rows`` rows of the weights' dtype, each way of ``ways`` (``kernel``
    among them) timed; the ratios are each other way's time over the kernel's."""
    dtype = weights[0].dtype
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}
    ms = gemm_ms(weights, ways, lambda weight: inputs[weight.shape[1]], rounds)
    with torch.inference_mode():
        x, weight = inputs[weights[2].shape[1]], weights[2]  # a gate_up projection
        product = torch.nn.functional.linear(x.float(), weight.float())
        differences = {
            name: float((way(x, weight).float() - product).abs().max())
            for name, way in ways.items()
        }
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    flops = sum(2 * rows * w.numel() for w in weights)
    return {
        "rows": rows,
        "ms": ms,
        **{f"{name}_over_kernel": ms[name] / ms["kernel"] for name in ms if name != "kernel"},
        "weight_GB_per_s": {name: weight_bytes / t / 1e6 for name, t in ms.items()},
        "GFLOP_per_s": {name: flops / t / 1e6 for name, t in ms.items()},
        "max_abs_difference_from_float32": differences,
    }


def kernel_up_to(llm: LLM, max_rows: int | None) -> None:
    """Run bfloat16 GEMMs of up to ``max_rows`` rows in the kernel (None: never)."""
    kernels = llm.engine.kernels
    gemm = replace(kernels.gemm, bfloat16_kernel_max_rows=max_rows)
    layer_by_layer(llm.engine.model, replace(kernels, gemm=gemm))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64, 128, 256, 512])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--name", default="bf16_gemm", help="the results file's name")
    parser.add_argument(
        "--against", metavar="REV", help="also time the kernel of this git revision"
    )
    args = parser.parse_args()
    if not bf16_gemm.KERNEL.available:
        raise SystemExit("the bf16_gemm kernel is not built here (it needs AVX-512 and gcc)")

    llm = build_in_ended_thread(lambda: LLM(dtype="bfloat16", enable_prefix_caching=False))
    weights = [w.detach() for w in gemm_weights(llm.engine.model)]
    probed = llm.engine.kernels.gemm.bfloat16_kernel_max_rows
    kernel = llm.engine.kernels.gemm.bfloat16_kernel
    print(f"the start-up probe runs GEMMs of up to {probed} rows in {kernel}", flush=True)
    ways = with_narrower_builds(WAYS)
    if args.against is not None:
        library = kernel_at_revision(bf16_gemm.KERNEL, args.against)
        ways[args.against] = functools.partial(bf16_gemm.bf16_linear, library=library)
    gemms = []
    for rows in args.rows:
        gemms.append(step_gemms(weights, rows, args.rounds, ways))
        print(f"gemms: {gemms[-1]}", flush=True)
    report = {
        "threads": torch.get_num_threads(),
        "step_gemms": gemms,
        "probed_kernel_max_rows": probed,
        "probed_kernel": kernel,
        "step_bfloat16_eager": alternate_steps(
            llm,
            args.concurrency,
            args.rounds,
            {
                "probed": lambda: kernel_up_to(llm, probed),
                "torch": lambda: kernel_up_to(llm, None),
            },
        ),
    }
    write_json(RESULTS / f"{args.name}.json", report, script_command(__file__))


if __name__ == "__main__":
    main()
