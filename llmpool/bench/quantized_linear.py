"""Quantized weights on CPU: step time of none / int8 / int4 in float32 and bfloat16, as ratios.

Two levels, each in one run with every configuration interleaved round by round (the CPU is
shared, so only ratios within a run mean anything; each time is the minimum over rounds):

- layers: each of the built-in model's matmul shapes (qkv, o, gate_up, down, LM head) at 1 row
  (decode at concurrency 1) and 64 rows (a batched step), as ``nn.Linear`` through the
  engine's ``linear``, ``Int8Linear`` and ``Int4Linear`` (the LM head is int8 under int4);
- model: ``EngineCore.step()`` of the built-in model decoding 1 and 64 sequences.

Ratios are unquantized time / quantized time of the same activation dtype (above 1: faster),
and the weight bytes one decode step reads (every matmul weight, scale and zero once).

    python benchmarks/quantized_linear.py [--rounds 7] [--steps 4] [--threads 1]

On a shared 2-core machine, one thread gives steadier ratios: two threads stall at every
matmul's barrier whenever another process holds the other core.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.engine import SamplingParams
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.kernels.capabilities import probe_kernels
from llmpool.engine.models.int4 import Int4Linear
from llmpool.engine.models.linear import Linear
from llmpool.engine.models.quantization import Int8Linear, weight_bytes

# SmolLM2-135M: (out, in) of each matmul.
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = (1, 64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZATIONS = ("none", "int8", "int4")
# llama.cpp's SmolLM2-135M-Instruct.Q4_1.gguf (the built-in model's source): tensor bytes per
# decode step, layers at Q4_1 (66,355,200) and the tied token embedding / head at Q8_0
# (30,081,024), norms F32 (140,544): read from the file with gguf.GGUFReader.
LLAMA_CPP_Q4_1_STEP_BYTES = 96_576_768
KERNELS = probe_kernels(torch.device("cpu"))


def min_time(function: Callable[[], object], inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        function()
    return (time.perf_counter() - start) / inner


def make_layer(quantization: str, weight: torch.Tensor, name: str) -> nn.Module:
    if quantization == "int8" or (quantization == "int4" and name == "lm_head"):
        return Int8Linear.from_float(weight, None, KERNELS)
    if quantization == "int4":
        return Int4Linear.from_float(weight, None, KERNELS)
    layer = Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight)
    return layer


def bench_layers(rounds: int) -> list[dict[str, object]]:
    cases: dict[tuple[str, int, str, str], Callable[[], object]] = {}
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features) * in_features**-0.5
        for dtype_name, dtype in DTYPES.items():
            layers = {q: make_layer(q, weight, name).to(dtype) for q in QUANTIZATIONS}
            for rows in ROWS:
                x = torch.randn(rows, in_features).to(dtype)
                for quantization, layer in layers.items():
                    key = (name, rows, dtype_name, quantization)
                    cases[key] = lambda layer=layer, x=x: layer(x)
    times: dict[tuple[str, int, str, str], float] = dict.fromkeys(cases, float("inf"))
    with torch.inference_mode():
        for function in cases.values():
            function()
        for _ in range(rounds):
            for key, function in cases.items():
                inner = 2 if key[0] == "lm_head" and key[1] > 1 else 5
                times[key] = min(times[key], min_time(function, inner))
    rows_out = []
    for (name, rows, dtype_name, quantization), seconds in times.items():
        base = times[(name, rows, dtype_name, "none")]
        rows_out.append(
            {
                "layer": name,
                "shape": SHAPES[name],
                "rows": rows,
                "dtype": dtype_name,
                "quantization": quantization,
                "us": round(seconds * 1e6, 1),
                "speedup_vs_none": round(base / seconds, 3),
            }
        )
    return rows_out


def decode_engines(concurrency: int) -> dict[tuple[str, str], EngineCore]:
    engines = {}
    for dtype_name in DTYPES:
        for quantization in QUANTIZATIONS:
            torch.manual_seed(0)
            core = EngineCore(
                EngineConfig(
                    dtype=dtype_name,
                    quantization=quantization,
                    max_model_len=1024,
                    kv_cache_memory="320MiB",
                    max_num_seqs=max(concurrency, 1),
                )
            )
            params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
            prompt = core.tokenizer.encode("Write a long story about a lighthouse keeper.")
            for index in range(concurrency):
                core.add_request(str(index), prompt, params)
            while any(len(r.output_token_ids) < 2 for r in core.scheduler.running) or (
                core.scheduler.waiting
            ):
                core.step()  # prefill, then one decode step each
            engines[(dtype_name, quantization)] = core
    return engines


def bench_model(concurrency: int, rounds: int, steps: int) -> list[dict[str, object]]:
    engines = decode_engines(concurrency)
    times = dict.fromkeys(engines, float("inf"))
    for _ in range(rounds):
        for key, core in engines.items():
            times[key] = min(times[key], min_time(core.step, steps))
    results = []
    for (dtype_name, quantization), seconds in times.items():
        core = engines[(dtype_name, quantization)]
        results.append(
            {
                "concurrency": concurrency,
                "dtype": dtype_name,
                "quantization": quantization,
                "step_ms": round(seconds * 1e3, 2),
                "speedup_vs_none": round(times[(dtype_name, "none")] / seconds, 3),
                "weight_bytes": weight_bytes(core.model),
                "decode_step_read_bytes": step_read_bytes(core),
            }
        )
    del engines
    return results


def step_read_bytes(core: EngineCore) -> int:
    """Bytes of every weight a decode step reads: the layers, the final norm and the LM head
    (the embedding table only for the rows looked up, so not counted unless tied to the head)."""
    embedding = core.model.embed_tokens
    embedding_tensors = {t.data_ptr() for t in [*embedding.parameters(), *embedding.buffers()]}
    head = core.model.lm_head
    head_tensors = (
        [head] if isinstance(head, torch.Tensor) else [*head.parameters(), *head.buffers()]
    )
    counted = {t.data_ptr() for t in head_tensors}
    total = sum(t.numel() * t.element_size() for t in head_tensors)
    for tensor in [*core.model.parameters(), *core.model.buffers()]:
        pointer = tensor.data_ptr()
        if pointer in counted or pointer in embedding_tensors or tensor is core.model.cos_sin_cache:
            continue
        counted.add(pointer)
        total += tensor.numel() * tensor.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="engine steps per round")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own choice)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "quantized_linear.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    layers = bench_layers(args.rounds)
    model = [row for c in (1, 64) for row in bench_model(c, args.rounds, args.steps)]
    result = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "seconds": round(time.time() - started),
        "llama_cpp_q4_1_step_read_bytes": LLAMA_CPP_Q4_1_STEP_BYTES,
        "layers": layers,
        "model": model,
    }
    write_json(args.output, result, script_command(__file__))
    for row in layers:
        print(
            f"{row['layer']:8} rows {row['rows']:3} {row['dtype']:8} {row['quantization']:5}"
            f" {row['us']:10.1f} us  x{row['speedup_vs_none']:.2f}"
        )
    for row in model:
        print(
            f"model c={row['concurrency']:<3} {row['dtype']:8} {row['quantization']:5}"
            f" {row['step_ms']:8.2f} ms  x{row['speedup_vs_none']:.2f}"
            f"  reads {row['decode_step_read_bytes']:,} B per decode step"
        )


if __name__ == "__main__":
    main()
