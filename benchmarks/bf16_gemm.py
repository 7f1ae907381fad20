"""Few-row bfloat16 GEMMs on CPU: the ``bf16_gemm`` C kernel against torch, and the step.

Two measurements, each alternating between the ways in one process:

- a decode step's GEMMs alone (every layer's four projections and the LM head of the built-in
  model, 269 MB of bfloat16 weights, so they stream from memory as in a step) at ``--rows``
  rows, three ways: torch's bfloat16 GEMM (oneDNN), the C kernel, and the float32 GEMM on
  upcast operands (what ``linear`` runs for prefill chunks past the kernel's rows); with the
  weight bandwidth and GFLOP/s of each and the largest difference from the float32 product;
- the engine's whole eager bfloat16 step with ``--concurrency`` requests of 40-700-token prompts
  decoding, rounds of steps alternating between the kernel on and off (the choice is
  one engine: ``kernel_up_to``).

    python benchmarks/bf16_gemm.py --rows 1 4 16 64 128 256 512 --concurrency 1 16 64

Writes ``benchmarks/results/bf16_gemm.json`` with the CPU model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from decode_step import gemm_weights

from llmpool.bench.offline import cpu_model
from llmpool.engine import LLM, SamplingParams
from llmpool.engine.kernels import bf16_gemm
from llmpool.engine.models import linear

RESULTS = Path(__file__).parent / "results"
CONTEXT = (40, 700)


def upcast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)


WAYS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch": torch.nn.functional.linear,
    "kernel": bf16_gemm.bf16_linear,
    "upcast": upcast,
}


def step_gemms(weights: list[torch.Tensor], rows: int, rounds: int) -> dict[str, Any]:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=torch.bfloat16) for w in weights}
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms up
            for name, way in WAYS.items():
                started = time.perf_counter()
                for weight in weights:
                    way(inputs[weight.shape[1]], weight)
                times[name].append((time.perf_counter() - started) * 1e3)
        x, weight = inputs[weights[2].shape[1]], weights[2]  # a gate_up projection
        product = torch.nn.functional.linear(x.float(), weight.float())
        differences = {
            name: float((way(x, weight).float() - product).abs().max())
            for name, way in WAYS.items()
        }
    ms = {name: statistics.median(values[1:]) for name, values in times.items()}
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    flops = sum(2 * rows * w.numel() for w in weights)
    return {
        "rows": rows,
        "ms": ms,
        "torch_over_kernel": ms["torch"] / ms["kernel"],
        "upcast_over_kernel": ms["upcast"] / ms["kernel"],
        "weight_GB_per_s": {name: weight_bytes / t / 1e6 for name, t in ms.items()},
        "GFLOP_per_s": {name: flops / t / 1e6 for name, t in ms.items()},
        "max_abs_difference_from_float32": differences,
    }


def alternate_steps(
    llm: LLM, concurrencies: list[int], rounds: int, choices: dict[str, Callable[[], None]]
) -> list[dict[str, Any]]:
    """Median step time of ``llm`` at each concurrency under each of ``choices`` (name ->
    what switches to it), rounds of 4 steps alternating between them; the first choice is
    left on."""
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    first, second = choices
    rows = []
    for concurrency in concurrencies:
        rng = random.Random(concurrency)
        ids = [f"{concurrency}-{index}" for index in range(concurrency)]
        for request_id in ids:
            prompt = [rng.randrange(100, 40_000) for _ in range(rng.randint(*CONTEXT))]
            core.add_request(request_id, prompt, params)
        while core.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
        ):
            core.step()
        times: dict[str, list[float]] = {name: [] for name in choices}
        for _ in range(rounds):
            for name, switch in choices.items():
                switch()
                started = time.perf_counter()
                for _ in range(4):
                    core.step()
                times[name].append((time.perf_counter() - started) / 4 * 1e3)
        core.abort_requests(ids)
        medians = {name: statistics.median(values) for name, values in times.items()}
        rows.append(
            {
                "concurrency": concurrency,
                "step_ms": medians,
                f"{second}_over_{first}": medians[second] / medians[first],
            }
        )
        print(f"step c={concurrency}: {rows[-1]}", flush=True)
    choices[first]()
    return rows


def kernel_up_to(llm: LLM, max_rows: int | None) -> None:
    """Run bfloat16 GEMMs of up to ``max_rows`` rows in the kernel (None: never)."""
    kernels = llm.engine.kernels
    gemm = replace(kernels.gemm, bfloat16_kernel_max_rows=max_rows)
    llm.engine.model.use_kernels(replace(kernels, gemm=gemm))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64, 128, 256, 512])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not bf16_gemm.KERNEL.available:
        raise SystemExit("the bf16_gemm kernel is not built here (it needs AVX-512 and gcc)")

    def build() -> LLM:
        return LLM(dtype="bfloat16", enable_prefix_caching=False)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a thread that ends: see decode_step
        llm = pool.submit(build).result()
    weights = [w.detach() for w in gemm_weights(llm.engine.model)]
    gemms = []
    for rows in args.rows:
        gemms.append(step_gemms(weights, rows, args.rounds))
        print(f"gemms: {gemms[-1]}", flush=True)
    report = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "step_gemms": gemms,
        "step_bfloat16_eager": alternate_steps(
            llm,
            args.concurrency,
            args.rounds,
            {
                "kernel": lambda: kernel_up_to(llm, linear.BFLOAT16_KERNEL_MAX_ROWS),
                "torch": lambda: kernel_up_to(llm, None),
            },
        ),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bf16_gemm.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
