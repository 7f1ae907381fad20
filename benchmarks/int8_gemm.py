"""Few-row int8 weight-only GEMMs on CPU: the ``int8_gemm`` VNNI kernel against torch, and the step.

Two measurements, each alternating between the ways in one process:

- an int8 decode step's GEMMs alone (every layer's four projections and the LM head of the
  built-in model with ``--quantization int8``, 135 MB of int8 weights, so they stream from memory
  as in a step) at ``--rows`` rows, three ways: torch's weight-only kernel
  (``_weight_int8pack_mm``, rows in bfloat16), the VNNI kernel, and ``int8_split_matmul`` (what
  int8 layers run past the kernels' rows), with the weight bandwidth of each;
- the engine's whole eager bfloat16 step with ``--concurrency`` requests decoding, for int4
  (whose LM head is int8) and int8, rounds of steps alternating between the kernel on and off
  (``int8_gemm.set_enabled``; off, decodes of up to ``INT8_KERNEL_MAX_ROWS`` rows take torch's
  kernel).

    python benchmarks/int8_gemm.py --rows 1 4 16 32 --concurrency 1 16

Writes ``benchmarks/results/int8_gemm.json`` with the CPU model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bf16_gemm import alternate_steps

from llmpool.bench.offline import cpu_model
from llmpool.engine import LLM
from llmpool.engine.models import int8_gemm
from llmpool.engine.models.quantization import Int8Linear, int8_split_matmul

RESULTS = Path(__file__).parent / "results"


def torchs_kernel(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    return torch._weight_int8pack_mm(x.bfloat16(), layer.weight, layer.kernel_scale)


WAYS: dict[str, Callable[[torch.Tensor, Int8Linear], torch.Tensor]] = {
    "torch": torchs_kernel,
    "kernel": lambda x, layer: int8_gemm.int8_linear(
        x, layer.weight, layer.weight_sums, layer.float_scale
    ),
    "split": lambda x, layer: int8_split_matmul(x, layer.weight, layer.scale),
}


def int8_layers(llm: LLM) -> list[Int8Linear]:
    model = llm.engine.model
    layers = [
        proj
        for layer in model.layers
        for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ]
    return [*layers, model.lm_head]


def step_gemms(layers: list[Int8Linear], rows: int, rounds: int) -> dict[str, Any]:
    inputs = {
        layer.weight.shape[1]: torch.randn(rows, layer.weight.shape[1], dtype=torch.bfloat16)
        for layer in layers
    }
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms up
            for name, way in WAYS.items():
                started = time.perf_counter()
                for layer in layers:
                    way(inputs[layer.weight.shape[1]], layer)
                times[name].append((time.perf_counter() - started) * 1e3)
    ms = {name: statistics.median(values[1:]) for name, values in times.items()}
    weight_bytes = sum(layer.weight.numel() for layer in layers)
    return {
        "rows": rows,
        "ms": ms,
        "torch_over_kernel": ms["torch"] / ms["kernel"],
        "split_over_kernel": ms["split"] / ms["kernel"],
        "weight_GB_per_s": {name: weight_bytes / t / 1e6 for name, t in ms.items()},
    }


def build(quantization: str) -> LLM:
    def make() -> LLM:
        return LLM(dtype="bfloat16", quantization=quantization, enable_prefix_caching=False)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a thread that ends: see decode_step
        return pool.submit(make).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not int8_gemm.available():
        raise SystemExit("the int8_gemm kernel is not built here (it needs AVX-512 VNNI and gcc)")
    choices = {
        "kernel": lambda: int8_gemm.set_enabled(True),
        "torch": lambda: int8_gemm.set_enabled(False),
    }
    llm = build("int8")
    gemms = []
    for rows in args.rows:
        gemms.append(step_gemms(int8_layers(llm), rows, args.rounds))
        print(f"gemms: {gemms[-1]}", flush=True)
    report: dict[str, Any] = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "step_gemms": gemms,
    }
    report["step_int8_eager"] = alternate_steps(llm, args.concurrency, args.rounds, choices)
    del llm
    report["step_int4_eager"] = alternate_steps(
        build("int4"), args.concurrency, args.rounds, choices
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8_gemm.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
