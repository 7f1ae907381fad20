"""The decode step, eager against compiled, and how close it runs to the GEMM roof.

One process, per dtype: an eager engine and a compiled one (``EngineConfig.compile``) hold the
same ``--concurrency`` decoding requests; rounds alternate between them (``--rounds`` rounds of
``--steps`` steps each) so that load from outside falls on both alike, and the median step time
of each is reported with the ratio eager / compiled.

The roof is measured in the same run: the step's GEMMs alone (every layer's four projections
and the LM head, on the model's own weights, with the step's rows) timed back to back through
``torch.nn.functional.linear``. The step's GEMM work divided by the step time, over that roof,
is the fraction of the matmul roof the whole step reaches. A 2048-cubed GEMM is reported too,
as the library's peak on this CPU.

Both engines are built in a thread that has ended before the main thread steps them, so the
main thread's OpenMP team is the process's only one (``llmpool.bench.launch`` says why).

    python benchmarks/decode_step.py --dtypes bfloat16 float32 --concurrency 1 16 64

Writes ``benchmarks/results/decode_step.json`` and ``.md`` (``decode_step_int4.*`` with
``--quantization int4``) with the CPU model; the roof is of dense GEMMs, so quantized runs
report none.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from llmpool.bench.launch import build_in_ended_thread
from llmpool.bench.results import script_command, write_report
from llmpool.bench.stats import median_seconds
from llmpool.bench.steps import ENDLESS, alternating_step_ms, gemm_weights, start_decoding
from llmpool.engine import LLM
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.models.llama import LlamaForCausalLM

PROMPT = list(range(1000, 1064))  # clear of special tokens
MAX_BATCHED_TOKENS = 512  # prompts take a few steps; the compiled sizes stop here


def gemm_roof(model: LlamaForCausalLM, rows: int, repeats: int) -> tuple[float, float]:
    """``(flops per step, GFLOP/s)`` of the step's GEMMs alone with ``rows`` rows."""
    weights = gemm_weights(model)
    dtype = weights[0].dtype
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)

    def run() -> None:
        for weight in weights:
            torch.nn.functional.linear(inputs[weight.shape[1]], weight)

    with torch.inference_mode():
        return flops, flops / median_seconds(run, repeats) / 1e9


def peak_gflops(dtype: torch.dtype) -> float:
    a = torch.randn(2048, 2048, dtype=dtype)
    return 2 * 2048**3 / median_seconds(lambda: a @ a, 5) / 1e9


def measure(
    engines: dict[str, EngineCore], concurrency: int, rounds: int, steps: int
) -> dict[str, Any]:
    ids = [f"c{concurrency}-{index}" for index in range(concurrency)]
    for engine in engines.values():
        start_decoding(engine, ids, [PROMPT] * concurrency, ENDLESS)
    steppers = {name: engine.step for name, engine in engines.items()}
    medians = alternating_step_ms(steppers, rounds, steps, before=steppers)
    for engine in engines.values():
        engine.abort_requests(ids)
    row: dict[str, Any] = {
        "concurrency": concurrency,
        "step_ms": medians,
        "eager_over_compiled": medians["eager"] / medians["compiled"],
    }
    if engines["eager"].config.quantization == "none":  # the roof is of dense GEMMs
        flops, roof = gemm_roof(engines["eager"].model, concurrency, repeats=rounds)
        row |= {"gemm_roof_gflops": roof, "gemm_gflop_per_step": flops / 1e9}
        for name, ms in medians.items():
            row[f"{name}_fraction_of_roof"] = flops / (ms / 1e3) / 1e9 / roof
    return row


def build_engines(dtype: str, quantization: str, max_num_seqs: int) -> dict[str, EngineCore]:
    """An eager and a compiled engine, built in a thread that ends before they are stepped."""

    def build() -> dict[str, EngineCore]:
        return {
            name: LLM(
                dtype=dtype,
                compile=name == "compiled",
                quantization=quantization,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=MAX_BATCHED_TOKENS,
            ).engine
            for name in ("eager", "compiled")
        }

    return build_in_ended_thread(build)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"CPU: {result['cpu']}, {result['threads']} threads; peak GEMM (2048³):"
        + ", ".join(f" {d} {g:.0f} GFLOP/s" for d, g in result["peak_gflops"].items()),
        "",
        "| dtype | quantization | concurrency | eager ms/step | compiled ms/step | eager/compiled"
        " | GEMM roof GFLOP/s | eager % roof | compiled % roof |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        roof = (
            f"{row['gemm_roof_gflops']:.0f} | {100 * row['eager_fraction_of_roof']:.0f}%"
            f" | {100 * row['compiled_fraction_of_roof']:.0f}%"
            if "gemm_roof_gflops" in row
            else "- | - | -"
        )
        lines.append(
            f"| {row['dtype']} | {row['quantization']} | {row['concurrency']}"
            f" | {row['step_ms']['eager']:.1f} | {row['step_ms']['compiled']:.1f}"
            f" | {row['eager_over_compiled']:.2f}x | {roof} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        engines = build_engines(dtype, args.quantization, max(args.concurrency))
        for concurrency in args.concurrency:
            row = {"dtype": dtype, "quantization": args.quantization} | measure(
                engines, concurrency, args.rounds, args.steps
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
        del engines
    result = {
        "threads": torch.get_num_threads(),
        "peak_gflops": {d: peak_gflops(getattr(torch, d)) for d in args.dtypes},
        "rows": rows,
    }
    name = "decode_step" if args.quantization == "none" else f"decode_step_{args.quantization}"
    write_report(name, result, script_command(__file__), markdown)


if __name__ == "__main__":
    main()
