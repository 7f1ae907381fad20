"""Decode attention on CPU: the cpu backend (``cpu_decode.c``) against the torch backend.

Two measurements, each alternating between the two backends in one process:

- one layer's attention for ``c`` decodes of 40-700-token contexts (random block tables over a
  shared pool, SmolLM2's 9 query and 3 KV heads of 64), both dtypes, with the largest
  difference between the outputs;
- the engine's whole decode step (bfloat16) with ``c`` requests of such prompts decoding,
  one engine per backend, rounds of steps alternating between them.

    python benchmarks/decode_attention.py --concurrency 1 16 64

Writes ``benchmarks/results/decode_attention.json`` with the CPU model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from llmpool.bench.offline import cpu_model
from llmpool.engine import LLM, SamplingParams
from llmpool.engine.attention import CPU, TORCH, AttentionMetadata, Backend

RESULTS = Path(__file__).parent / "results"
BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 9, 3, 64
CONTEXT = (40, 700)


def decode_batch(concurrency: int, seed: int) -> AttentionMetadata:
    rng = random.Random(seed)
    lens = [rng.randint(*CONTEXT) for _ in range(concurrency)]
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    physical = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(seed))
    tables = torch.zeros(concurrency, max(blocks), dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = physical[start : start + count]
        start += count
    return AttentionMetadata(
        slot_mapping=torch.zeros(concurrency, dtype=torch.int64),
        query_start_loc=torch.arange(concurrency + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=max(lens),
        block_size=BLOCK_SIZE,
    )


def layer_microseconds(concurrency: int, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    meta = decode_batch(concurrency, seed=concurrency)
    num_blocks = int(meta.block_tables.max()) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    query = torch.randn(concurrency, NUM_HEADS, HEAD_DIM).to(dtype)
    backends: dict[str, Backend] = {"torch": TORCH, "cpu": CPU}
    plans = {name: backend.plan(meta) for name, backend in backends.items()}
    times: dict[str, list[float]] = {name: [] for name in backends}
    outputs = {}
    for _ in range(rounds):
        for name, backend in backends.items():
            started = time.perf_counter()
            for _ in range(10):
                outputs[name] = backend.paged_attention(
                    query, key_cache, value_cache, plans[name], HEAD_DIM**-0.5
                )
            times[name].append((time.perf_counter() - started) / 10 * 1e6)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "us": medians,
        "torch_over_cpu": medians["torch"] / medians["cpu"],
        "max_abs_difference": float(
            (outputs["torch"].float() - outputs["cpu"].float()).abs().max()
        ),
    }


def step_milliseconds(concurrencies: list[int], rounds: int) -> list[dict[str, Any]]:
    def build(backend: str) -> LLM:
        return LLM(dtype="bfloat16", enable_prefix_caching=False, attention_backend=backend)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a thread that ends: see decode_step
        engines = {name: pool.submit(build, name).result() for name in ("torch", "cpu")}
    rows = []
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for concurrency in concurrencies:
        rng = random.Random(concurrency)
        prompts = [
            [rng.randrange(100, 40_000) for _ in range(rng.randint(*CONTEXT))]
            for _ in range(concurrency)
        ]
        ids = [f"{concurrency}-{index}" for index in range(concurrency)]
        for llm in engines.values():
            core = llm.engine
            for request_id, prompt in zip(ids, prompts, strict=True):
                core.add_request(request_id, prompt, params)
            while core.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
            ):
                core.step()
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(rounds):
            for name, llm in engines.items():
                started = time.perf_counter()
                for _ in range(4):
                    llm.engine.step()
                times[name].append((time.perf_counter() - started) / 4 * 1e3)
        for llm in engines.values():
            llm.engine.abort_requests(ids)
        medians = {name: statistics.median(values) for name, values in times.items()}
        rows.append(
            {
                "concurrency": concurrency,
                "step_ms": medians,
                "torch_over_cpu": medians["torch"] / medians["cpu"],
            }
        )
        print(f"step c={concurrency}: {rows[-1]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    layers = []
    for dtype in (torch.bfloat16, torch.float32):
        for concurrency in args.concurrency:
            row = {"dtype": str(dtype).removeprefix("torch."), "concurrency": concurrency}
            row |= layer_microseconds(concurrency, dtype, args.rounds)
            layers.append(row)
            print(f"layer: {row}", flush=True)
    report = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "layer": layers,
        "step_bfloat16": step_milliseconds(args.concurrency, args.rounds),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decode_attention.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
