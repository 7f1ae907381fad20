"""Few-row quantized GEMMs on CPU: the ``vnni_gemm`` kernels against torch's, and the step.

Two measurements, each alternating between the ways in one process:

- a decode step's quantized GEMMs alone at ``--rows`` rows (every layer's four projections and,
  under int8, the LM head, on the built-in model's own weights, so that they stream from memory
  as in a step): under int8 (135 MB) torch's weight-only kernel (``_weight_int8pack_mm``, rows
  in bfloat16), the VNNI kernel and ``int8_split_matmul`` (what int8 layers run past the
  kernels' rows); under int4 (66 MB of layers) torch's ``_weight_int4pack_mm_for_cpu``, the
  kernel on bfloat16 rows (AMX tiles where built, from ``INT4_AMX_MIN_ROWS``), the integer
  kernel on the same rows in float32, and dequantizing per call into torch's bfloat16 GEMM;
  with the weight bandwidth of each;
- the engine's whole eager bfloat16 step with ``--concurrency`` requests decoding under int8 and
  int4 (whose LM head is int8), rounds of steps alternating between the kernels on and off
  (``LlamaForCausalLM.use_kernels``).

    python benchmarks/vnni_gemm.py --rows 1 2 4 16 --concurrency 1 2 16

Writes ``benchmarks/results/vnni_gemm.json`` (``--name``: another name) with the CPU model;
``--quantization`` measures one kind only.
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
from llmpool.bench.steps import alternate_steps, gemm_ms
from llmpool.engine import LLM
from llmpool.engine.kernels import vnni_gemm
from llmpool.engine.models.int4 import INT4_GROUP_SIZE, Int4Linear
from llmpool.engine.models.quantization import Int8Linear, int8_split_matmul

Way = Callable[[torch.Tensor, Any], torch.Tensor]

INT8_WAYS: dict[str, Way] = {
    "torch": lambda x, layer: torch._weight_int8pack_mm(
        x.bfloat16(), layer.weight, layer.kernel_scale
    ),
    "kernel": lambda x, layer: vnni_gemm.int8_linear(
        x, layer.weight, layer.weight_sums, layer.float_scale
    ),
    "split": lambda x, layer: int8_split_matmul(x, layer.weight, layer.scale),
}
INT4_WAYS: dict[str, Way] = {
    "torch": lambda x, layer: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16(), layer.weight, INT4_GROUP_SIZE, layer.scales_and_zeros
    ),
    # bfloat16 rows: on AMX tiles from vnni_gemm.INT4_AMX_MIN_ROWS where the build has them
    "kernel": lambda x, layer: vnni_gemm.int4_linear(x, layer.weight, layer.scales_and_zeros_bits),
    # the same rows as float32: the integer (VNNI) kernel at every row count
    "integer": lambda x, layer: vnni_gemm.int4_linear(
        x.float(), layer.weight, layer.scales_and_zeros_bits
    ),
    # what large bfloat16 batches run (int4.INT4_DEQUANTIZED_MIN_ROWS), dequantizing per call
    "dequantized": lambda x, layer: (
        x.bfloat16() @ vnni_gemm.int4_dequantize(layer.weight, layer.scales_and_zeros_bits)
    ),
}


def quantized_layers(llm: LLM) -> list[Int8Linear | Int4Linear]:
    """Every layer's projections, and the LM head where it is of the layers' kind (int8)."""
    model = llm.engine.model
    layers = [
        proj
        for layer in model.layers
        for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ]
    return [*layers, model.lm_head] if isinstance(layers[0], Int8Linear) else layers


def step_gemms(layers: list[Any], ways: dict[str, Way], rows: int, rounds: int) -> dict[str, Any]:
    def width(layer: Any) -> int:
        """Input features (int4 packs two per byte)."""
        return layer.weight.shape[1] * (2 if isinstance(layer, Int4Linear) else 1)

    inputs = {
        width(layer): torch.randn(rows, width(layer), dtype=torch.bfloat16) for layer in layers
    }
    ms = gemm_ms(layers, ways, lambda layer: inputs[width(layer)], rounds)
    weight_bytes = sum(layer.weight.numel() for layer in layers)
    return {
        "rows": rows,
        "ms": ms,
        **{f"{name}_over_kernel": ms[name] / ms["kernel"] for name in ways if name != "kernel"},
        "weight_GB_per_s": {name: weight_bytes / t / 1e6 for name, t in ms.items()},
    }


def build(quantization: str) -> LLM:
    return build_in_ended_thread(
        lambda: LLM(dtype="bfloat16", quantization=quantization, enable_prefix_caching=False)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 16])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--quantization", nargs="+", choices=["int8", "int4"], default=["int8", "int4"]
    )
    parser.add_argument("--name", default="vnni_gemm", help="the results file's name")
    args = parser.parse_args()
    if not vnni_gemm.KERNEL.available:
        raise SystemExit("the vnni_gemm kernels are not built here (AVX-512 VNNI and VBMI, gcc)")
    report: dict[str, Any] = {"threads": torch.get_num_threads()}
    for quantization, ways in (("int8", INT8_WAYS), ("int4", INT4_WAYS)):
        if quantization not in args.quantization:
            continue
        llm = build(quantization)
        gemms = []
        for rows in args.rows:
            gemms.append(step_gemms(quantized_layers(llm), ways, rows, args.rounds))
            print(f"{quantization} gemms: {gemms[-1]}", flush=True)
        report[f"{quantization}_step_gemms"] = gemms
        use, kernels = llm.engine.model.use_kernels, llm.engine.kernels
        choices = {
            "kernel": functools.partial(use, kernels),
            "torch": functools.partial(use, replace(kernels, vnni_gemm=False)),
        }
        steps = alternate_steps(llm, args.concurrency, args.rounds, choices)
        report[f"{quantization}_step_eager"] = steps
        del llm
    write_json(RESULTS / f"{args.name}.json", report, script_command(__file__))


if __name__ == "__main__":
    main()
