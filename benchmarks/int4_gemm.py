"""int4 GEMMs of few rows on CPU: the ``int4_gemm`` C kernel against torch's packed kernel.

Two measurements, each alternating between the two in one process:

- a decode step's int4 GEMMs alone (every layer's four projections of the built-in model under
  ``--quantization int4``, 66 MB of codes, scales and zeros, streamed from memory as in a step)
  at ``--rows`` rows, with the weight bandwidth of each and the largest difference between them;
- the engine's whole eager int4 step with ``--concurrency`` requests of 40-700-token prompts
  decoding, rounds of steps alternating between the kernel on and off (process-wide:
  ``int4_gemm.set_max_rows``).

    python benchmarks/int4_gemm.py --rows 1 2 4 16 --concurrency 1 2

Writes ``benchmarks/results/int4_gemm.json`` with the CPU model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmpool.bench.offline import cpu_model
from llmpool.engine import LLM, SamplingParams
from llmpool.engine.models import int4_gemm
from llmpool.engine.models.int4 import Int4Linear

RESULTS = Path(__file__).parent / "results"
CONTEXT = (40, 700)


def torchs(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, layer.weight, layer.group_size, layer.scales_and_zeros
    )


def kernels(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    return int4_gemm.int4_linear(x, layer.weight, layer.scales_and_zeros_bits, layer.group_size)


WAYS: dict[str, Callable[[torch.Tensor, Int4Linear], torch.Tensor]] = {
    "torch": torchs,
    "kernel": kernels,
}


def step_gemms(layers: list[Int4Linear], rows: int, rounds: int) -> dict[str, Any]:
    widths = {2 * layer.weight.shape[1] for layer in layers}
    inputs = {width: torch.randn(rows, width, dtype=torch.bfloat16) for width in widths}
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms up
            for name, way in WAYS.items():
                started = time.perf_counter()
                for layer in layers:
                    way(inputs[2 * layer.weight.shape[1]], layer)
                times[name].append((time.perf_counter() - started) * 1e3)
        x, layer = inputs[2 * layers[2].weight.shape[1]], layers[2]  # a gate_up projection
        difference = float((torchs(x, layer).float() - kernels(x, layer).float()).abs().max())
    ms = {name: statistics.median(values[1:]) for name, values in times.items()}
    weight_bytes = sum(b.numel() * b.element_size() for layer in layers for b in layer.buffers())
    return {
        "rows": rows,
        "ms": ms,
        "torch_over_kernel": ms["torch"] / ms["kernel"],
        "weight_GB_per_s": {name: weight_bytes / t / 1e6 for name, t in ms.items()},
        "max_abs_difference": difference,
    }


def step_milliseconds(llm: LLM, concurrencies: list[int], rounds: int) -> list[dict[str, Any]]:
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    choices = {"kernel": int4_gemm.MAX_ROWS, "torch": None}
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
            for name, max_rows in choices.items():
                int4_gemm.set_max_rows(max_rows)
                started = time.perf_counter()
                for _ in range(8):
                    core.step()
                times[name].append((time.perf_counter() - started) / 8 * 1e3)
        core.abort_requests(ids)
        medians = {name: statistics.median(values) for name, values in times.items()}
        rows.append(
            {
                "concurrency": concurrency,
                "step_ms": medians,
                "torch_over_kernel": medians["torch"] / medians["kernel"],
            }
        )
        print(f"step c={concurrency}: {rows[-1]}", flush=True)
    int4_gemm.set_max_rows(choices["kernel"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 16])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not int4_gemm.available():
        raise SystemExit("the int4_gemm kernel is not built here (it needs AVX-512 and gcc)")

    def build() -> LLM:
        return LLM(dtype="bfloat16", quantization="int4", enable_prefix_caching=False)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a thread that ends: see decode_step
        llm = pool.submit(build).result()
    layers = [
        projection
        for layer in llm.engine.model.layers
        for projection in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ]
    gemms = []
    for rows in args.rows:
        gemms.append(step_gemms(layers, rows, args.rounds))
        print(f"gemms: {gemms[-1]}", flush=True)
    report = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "step_gemms": gemms,
        "step_int4_eager": step_milliseconds(llm, args.concurrency, args.rounds),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int4_gemm.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
