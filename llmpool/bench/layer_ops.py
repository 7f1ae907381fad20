"""A layer's norms, rotary and SiLU-and-mul on CPU: ``cpu_layer_ops.c`` against the torch
reference (``ops``).

- Per op: ``fused_add_rms_norm``, ``rotary_embedding`` and ``silu_and_mul`` at SmolLM2's sizes
  (hidden 576, 9 query and 3 KV heads of 64, intermediate 1536) and 1-2,048 rows (``--rows``;
  2,048: a whole prefill step), kernel and reference alternating.
- The whole decode step, layer by layer: one engine (``--dtype``, default auto) whose model's
  backend is switched between the cpu backend with the kernel and the same backend with the
  reference ops, rounds of steps alternating between the two.

    python benchmarks/layer_ops.py --concurrency 1 16 64

Writes ``benchmarks/results/layer_ops.json`` with the CPU model.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from llmpool.bench.launch import build_in_ended_thread
from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.steps import alternate_steps, alternating_step_ms, per_dtype
from llmpool.engine import LLM, ops
from llmpool.engine.attention import cpu_backend_with
from llmpool.engine.kernels import cpu_layer_ops

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536
OPS = ("norm", "rotary", "silu")


def op_microseconds(rows: int, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    x, residual = torch.randn(2, rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    query = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    key = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    cos_sin, positions = torch.randn(8192, HEAD_DIM), torch.randint(0, 8192, (rows,))
    gate_up = torch.randn(rows, 2 * INTERMEDIATE).to(dtype)

    def norm(module: Any) -> Callable[[], object]:
        return lambda: module.fused_add_rms_norm(x, residual, weight, 1e-5)

    def rotary(module: Any) -> Callable[[], object]:
        return lambda: module.rotary_embedding(positions, query, key, cos_sin)

    def silu(module: Any) -> Callable[[], object]:
        return lambda: module.silu_and_mul(gate_up)

    ways = {
        f"{op.__name__}_{way}": op(module)
        for op in (norm, rotary, silu)
        for way, module in (("reference", ops), ("kernel", cpu_layer_ops))
    }
    with torch.inference_mode():
        ms = alternating_step_ms(ways, rounds, steps=max(2, 200 * 16 // max(rows, 16)))
    us = {name: value * 1e3 for name, value in ms.items()}
    return {"us": us} | {
        f"{op}_reference_over_kernel": us[f"{op}_reference"] / us[f"{op}_kernel"] for op in OPS
    }


def step_milliseconds(dtype: str, concurrencies: list[int], rounds: int) -> list[dict[str, Any]]:
    llm = build_in_ended_thread(lambda: LLM(dtype=dtype, enable_prefix_caching=False))
    model = llm.engine.model
    model.cpu_decoder = None  # every step layer by layer, where the backends differ
    kernel = model.backend
    if kernel.fused_add_rms_norm is not cpu_layer_ops.fused_add_rms_norm:
        raise SystemExit(f"the engine's {kernel.name} backend does not run cpu_layer_ops.c here")
    reference = cpu_backend_with(dataclasses.replace(llm.engine.kernels, cpu_layer_ops=False))

    def use(backend: Any) -> Callable[[], None]:
        return lambda: setattr(model, "backend", backend)

    return alternate_steps(
        llm, concurrencies, rounds, {"kernel": use(kernel), "reference": use(reference)}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 512, 2048])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--name", default="layer_ops")
    args = parser.parse_args()
    report = {
        "threads": torch.get_num_threads(),
        "ops": per_dtype(
            "rows", args.rows, lambda rows, dtype: op_microseconds(rows, dtype, args.rounds)
        ),
        "step": step_milliseconds(args.dtype, args.concurrency, args.rounds),
    }
    write_json(RESULTS / f"{args.name}.json", report, script_command(__file__))


if __name__ == "__main__":
    main()
