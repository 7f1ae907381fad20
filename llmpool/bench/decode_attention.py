"""Decode attention on CPU: the cpu backend (``cpu_decode.c``) against the torch backend.

Two measurements, each alternating between the ways in one process:

- a step's attention for ``c`` decodes of 40-700-token contexts (random block tables over a
  shared pool, SmolLM2's 9 query and 3 KV heads of 64, each of its 30 layers its own cache, so
  that K and V stream from memory as in a step), both dtypes, with the largest difference
  between the outputs: the torch backend, the cpu backend, the cpu backend's kernel built
  portable (no instruction-set flags: what the vector code is measured against) and, on CPUs
  with AMX, built without its tiles (``vector``: the vector code's scores);
- the engine's whole decode step (bfloat16) with ``c`` requests of such prompts decoding,
  one engine per backend, rounds of steps alternating between them.

``--against REV`` adds to the first the kernel as it was at git revision ``REV`` (``cpu_decode.c``
and its headers then, built for this CPU as the current one is) and the current build, both
called directly, so that a change to the kernel is timed against what it replaced in one
process, with whether their outputs are equal.

    python benchmarks/decode_attention.py --concurrency 1 16 64

Writes ``benchmarks/results/decode_attention.json`` (``--name``: another name) with the CPU
model.
"""

from __future__ import annotations

import argparse
import ctypes
import random
from collections.abc import Callable
from typing import Any

import torch

from llmpool.bench.launch import build_in_ended_thread
from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.revision import kernel_at_revision
from llmpool.bench.steps import (
    CONTEXT,
    ENDLESS,
    alternating_step_ms,
    paged_batch,
    per_dtype,
    random_prompts,
    start_decoding,
)
from llmpool.engine import LLM
from llmpool.engine.attention import TORCH, AttentionMetadata, Backend, select_backend
from llmpool.engine.kernels import c_loader, cpu_decode
from llmpool.engine.kernels.capabilities import probe_kernels
from llmpool.engine.kv_cache import LayerKVCache

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, LAYERS = 16, 9, 3, 64, 30


def layer_microseconds(
    concurrency: int, dtype: torch.dtype, rounds: int, against: str | None = None
) -> dict[str, Any]:
    """A step's attention (``LAYERS`` layers), in microseconds; with ``against``, also through
    the kernel of that git revision."""
    meta, caches, query = decodes(concurrency, dtype)
    cpu = torch.device("cpu")
    backends: dict[str, Backend] = {
        "torch": TORCH,
        "cpu": select_backend(cpu, "cpu", dtype, kernels=probe_kernels(cpu)),
    }
    plans = {name: backend.plan(meta) for name, backend in backends.items()}
    outputs = {}

    def attend(name: str) -> Callable[[], None]:
        def run() -> None:
            for cache in caches:
                outputs[name] = backends[name].paged_attention(
                    query, cache, plans[name], HEAD_DIM**-0.5
                )

        return run

    def built(name: str, library: ctypes.CDLL) -> Callable[[], None]:
        def run() -> None:
            plan = plans["cpu"]
            for cache in caches:
                outputs[name] = cpu_decode.paged_decode(
                    query, cache.key, cache.value, plan.decode_block_tables,
                    plan.decode_seq_lens, HEAD_DIM**-0.5, library=library,
                )  # fmt: skip

        return run

    ways = {name: attend(name) for name in backends}
    builds = other_builds()  # built once, then found in the kernel cache
    if against is not None:
        builds |= against_builds(against)
    for name, library in builds.items():
        ways[name] = built(name, library)
    ms = alternating_step_ms(ways, rounds, steps=3)
    medians = {name: value * 1e3 for name, value in ms.items()}
    return {
        "us": medians,
        **{f"{name}_over_cpu": medians[name] / medians["cpu"] for name in medians if name != "cpu"},
        **({} if against is None else against_report(against, medians, outputs)),
        "max_abs_difference": {
            name: float((outputs["torch"].float() - outputs[name].float()).abs().max())
            for name in outputs
            if name != "torch"
        },
    }


def decodes(
    concurrency: int, dtype: torch.dtype
) -> tuple[AttentionMetadata, list[LayerKVCache], torch.Tensor]:
    """A step's decodes of 40-700-token contexts: their metadata (random block tables over one
    pool), each layer's own cache, and their queries."""
    rng = random.Random(concurrency)
    lens = [rng.randint(*CONTEXT) for _ in range(concurrency)]
    meta = paged_batch(lens, [1] * concurrency, BLOCK_SIZE, seed=concurrency)
    num_blocks = int(meta.block_tables.max()) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [
        LayerKVCache(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
        for _ in range(LAYERS)
    ]
    return meta, caches, torch.randn(concurrency, NUM_HEADS, HEAD_DIM).to(dtype)


def other_builds() -> dict[str, ctypes.CDLL]:
    """The decode kernel built portable and, where this CPU's build has AMX tiles, without."""
    builds = {"portable": cpu_decode.KERNEL.build([])}
    vector = c_loader.with_avx512_bf16(c_loader.arch_flags())
    if vector != cpu_decode.KERNEL.arch():
        builds["vector"] = cpu_decode.KERNEL.build(vector)
    return {name: library for name, library in builds.items() if library is not None}


def against_builds(revision: str) -> dict[str, ctypes.CDLL]:
    """The current build and ``revision``'s, both called as the other builds are (without the
    backend's planning), so that their times compare."""
    current = cpu_decode.KERNEL.library()
    if current is None:
        raise SystemExit("--against: cpu_decode.c does not build here")
    return {"current": current, revision: kernel_at_revision(cpu_decode.KERNEL, revision)}


def against_report(
    revision: str, medians: dict[str, float], outputs: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """How ``revision``'s kernel compares with the current one: time ratio, equal outputs."""
    return {
        f"{revision}_over_current": medians[revision] / medians["current"],
        f"{revision}_equal_to_current": torch.equal(outputs[revision], outputs["current"]),
    }


def step_milliseconds(concurrencies: list[int], rounds: int) -> list[dict[str, Any]]:
    engines = build_in_ended_thread(
        lambda: {
            name: LLM(dtype="bfloat16", enable_prefix_caching=False, attention_backend=name)
            for name in ("torch", "cpu")
        }
    )
    rows = []
    for concurrency in concurrencies:
        prompts = random_prompts(concurrency)
        ids = [f"{concurrency}-{index}" for index in range(concurrency)]
        for llm in engines.values():
            start_decoding(llm.engine, ids, prompts, ENDLESS)
        medians = alternating_step_ms(
            {name: llm.engine.step for name, llm in engines.items()}, rounds, steps=4
        )
        for llm in engines.values():
            llm.engine.abort_requests(ids)
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
    parser.add_argument("--name", default="decode_attention")
    parser.add_argument(
        "--against", metavar="REV", help="also time the kernel of this git revision"
    )
    args = parser.parse_args()
    report = {
        "threads": torch.get_num_threads(),
        "layer": per_dtype(
            "concurrency",
            args.concurrency,
            lambda concurrency, dtype: layer_microseconds(
                concurrency, dtype, args.rounds, args.against
            ),
        ),
        "step_bfloat16": step_milliseconds(args.concurrency, args.rounds),
    }
    write_json(RESULTS / f"{args.name}.json", report, script_command(__file__))


if __name__ == "__main__":
    main()
