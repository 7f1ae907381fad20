"""Few-row GEMMs on AVX2 CPUs: the ``avx2_gemm`` C kernels against torch, and the step.

Two measurements, each alternating between the ways in one process:

- a decode step's GEMMs alone (every layer's four projections and the LM head of the built-in
  model, 538 MB of float32 or 269 MB of bfloat16 weights, so they stream from memory as in a
  step) at ``--rows`` rows: float32 through torch (``linear``'s own float32 path) and the
  kernel; bfloat16 through torch, the kernel and the float32 GEMM on upcast operands; with the
  weight bandwidth and GFLOP/s of each and the largest difference from the float32 product;
- the engine's whole eager step, float32 and bfloat16, with ``--concurrency`` requests of
  40-700-token prompts decoding, rounds of steps alternating between the kernel on and off.

    python benchmarks/avx2_gemm.py --rows 1 4 16 64 --concurrency 1 16 64

Writes ``benchmarks/results/avx2_gemm.json`` with the CPU model.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from llmpool.bench.bf16_gemm import step_gemms, upcast
from llmpool.bench.launch import build_in_ended_thread
from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.steps import alternate_steps, gemm_weights, layer_by_layer
from llmpool.engine import LLM
from llmpool.engine.kernels import avx2_gemm
from llmpool.engine.models import linear
from llmpool.engine.models.linear import GemmChoice

FLOAT32_WAYS = {"torch": linear.linear, "kernel": avx2_gemm.f32_linear}
BFLOAT16_WAYS = {
    "torch": torch.nn.functional.linear,
    "kernel": avx2_gemm.bf16_linear,
    "upcast": upcast,
}
KERNEL_ON = {
    "float32": GemmChoice(float32_kernel_max_rows=linear.FLOAT32_KERNEL_MAX_ROWS),
    "bfloat16": GemmChoice(
        bfloat16_kernel_max_rows=linear.BFLOAT16_KERNEL_MAX_ROWS, bfloat16_kernel="avx2_gemm"
    ),
}


def use_gemm(llm: LLM, gemm: GemmChoice) -> None:
    layer_by_layer(llm.engine.model, replace(llm.engine.kernels, gemm=gemm))


def measure(dtype: str, rows: list[int], concurrency: list[int], rounds: int) -> dict[str, object]:
    llm = build_in_ended_thread(lambda: LLM(dtype=dtype, enable_prefix_caching=False))
    weights = [w.detach() for w in gemm_weights(llm.engine.model)]
    ways = FLOAT32_WAYS if dtype == "float32" else BFLOAT16_WAYS
    gemms = []
    for count in rows:
        gemms.append(step_gemms(weights, count, rounds, ways))
        print(f"{dtype} gemms: {gemms[-1]}", flush=True)
    steps = alternate_steps(
        llm,
        concurrency,
        rounds,
        {
            "kernel": lambda: use_gemm(llm, KERNEL_ON[dtype]),
            "torch": lambda: use_gemm(llm, GemmChoice()),
        },
    )
    return {"step_gemms": gemms, "step_eager": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not avx2_gemm.KERNEL.available:
        raise SystemExit("the avx2_gemm kernels are not built here (they need AVX2, FMA and gcc)")
    report: dict[str, object] = {"threads": torch.get_num_threads()}
    for dtype in args.dtypes:
        report[dtype] = measure(dtype, args.rows, args.concurrency, args.rounds)
    write_json(RESULTS / "avx2_gemm.json", report, script_command(__file__))


if __name__ == "__main__":
    main()
