"""Prefill attention on CPU: the cpu backend's ``cpu_prefill.c`` against the torch path it replaced.

Two measurements, each alternating between the ways in one process:

- one layer's attention for a step of multi-token queries (SmolLM2's 9 query and 3 KV heads of
  64, random block tables over a shared pool), both dtypes, with the largest difference from the
  torch path's output: the torch path (torch's flash attention over a padded copy, with a
  causal mask), the kernel, and, on AVX-512 CPUs, the kernel's AVX2 build and (where this
  build multiplies bfloat16 with ``vdpbf16ps``) its float32-FMA one. Two steps: ``prompts``,
  whole prompts of 40-700 tokens filling a 2,048-token step (a burst of new requests), and
  ``chunk``, a 512-token chunk of a prompt after 1,536 tokens already cached;
- the engine's whole prefill step (bfloat16 or ``--dtype``): 2,048 tokens of such prompts in one
  step, the cpu backend with and without the kernel, rounds alternating between them.

    python benchmarks/prefill_attention.py

Writes ``benchmarks/results/prefill_attention.json`` (``--name``: another name) with the CPU
model.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import itertools
import random
from collections.abc import Callable
from typing import Any

import torch

from llmpool.bench.launch import build_in_ended_thread
from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.bench.steps import CONTEXT, alternating_step_ms, paged_batch
from llmpool.engine import LLM, SamplingParams
from llmpool.engine.attention import TORCH, cpu_backend_with
from llmpool.engine.kernels import c_loader, cpu_prefill
from llmpool.engine.kernels.capabilities import probe_kernels
from llmpool.engine.kv_cache import LayerKVCache

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 9, 3, 64
STEP_TOKENS = 2048  # the engine's default max_num_batched_tokens


def prompt_lengths(seed: int) -> list[int]:
    """Prompts of ``CONTEXT`` tokens, the last one cut so that they fill ``STEP_TOKENS``."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < STEP_TOKENS:
        lengths.append(min(rng.randint(*CONTEXT), STEP_TOKENS - sum(lengths)))
    return lengths


STEPS = {  # name -> (seq_lens, query_lens)
    "prompts": (prompt_lengths(0), prompt_lengths(0)),
    "chunk": ([2048], [512]),
}


def other_builds() -> dict[str, ctypes.CDLL]:
    """On AVX-512 CPUs, the kernel as CPUs with less build it: AVX2 (8 lanes) and, where this
    CPU's build multiplies bfloat16 with vdpbf16ps, AVX-512 with float32 FMAs."""
    if c_loader.arch_flags() != c_loader.AVX512_BUILD:
        return {}
    builds = {"avx2": c_loader.AVX2_BUILD}
    if cpu_prefill.KERNEL.arch() != c_loader.AVX512_BUILD:
        builds["avx512_fma"] = c_loader.AVX512_BUILD
    libraries = {name: cpu_prefill.KERNEL.build(flags) for name, flags in builds.items()}
    return {name: library for name, library in libraries.items() if library is not None}


def layer_milliseconds(step: str, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    seq_lens, query_lens = STEPS[step]
    meta = paged_batch(seq_lens, query_lens, BLOCK_SIZE, seed=len(seq_lens))
    num_blocks = int(meta.block_tables.max()) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = LayerKVCache(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM).to(dtype)
    kernels = probe_kernels(torch.device("cpu"))
    if not kernels.cpu_prefill:
        raise SystemExit("cpu_prefill.c is not built on this machine (it needs AVX2 or AVX-512)")
    backends = {"torch": TORCH, "kernel": cpu_backend_with(kernels)}
    plans = {name: backend.plan(meta) for name, backend in backends.items()}
    outputs: dict[str, torch.Tensor] = {}

    def attend(name: str) -> Callable[[], None]:
        def run() -> None:
            outputs[name] = backends[name].paged_attention(
                query, cache, plans[name], HEAD_DIM**-0.5
            )

        return run

    def attend_with(name: str, library: ctypes.CDLL) -> None:
        out = torch.empty_like(query)
        cpu_prefill.paged_prefill(
            query, cache.key, cache.value, *plans["kernel"].prefills, out=out,
            scale=HEAD_DIM**-0.5, library=library,
        )  # fmt: skip
        outputs[name] = out

    ways = {name: attend(name) for name in backends}
    for name, library in other_builds().items():
        ways[name] = functools.partial(attend_with, name, library)

    ms = alternating_step_ms(ways, rounds, steps=3)
    return {
        "seqs": len(seq_lens),
        "query_tokens": sum(query_lens),
        "ms": ms,
        "torch_over_kernel": ms["torch"] / ms["kernel"],
        "max_abs_difference": {
            name: float((outputs["torch"].float() - outputs[name].float()).abs().max())
            for name in outputs
            if name != "torch"
        },
    }


def step_milliseconds(dtype: str, rounds: int) -> dict[str, Any]:
    """A 2,048-token prefill step of ``prompt_lengths`` prompts, added anew before every step."""
    llm = build_in_ended_thread(lambda: LLM(dtype=dtype, enable_prefix_caching=False))
    core = llm.engine
    model = core.model
    if not core.kernels.cpu_prefill or model.backend.name != "cpu":
        raise SystemExit("the engine's cpu backend does not run cpu_prefill.c here")
    backends = {
        "kernel": model.backend,
        "torch_path": cpu_backend_with(dataclasses.replace(core.kernels, cpu_prefill=False)),
    }
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in prompt_lengths(1)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    added: list[str] = []
    numbers = itertools.count()

    def prepare(name: str) -> Callable[[], None]:
        def run() -> None:
            core.abort_requests(added)
            added[:] = [f"{name}-{next(numbers)}" for _ in prompts]
            for request_id, prompt in zip(added, prompts, strict=True):
                core.add_request(request_id, prompt, params)
            model.backend = backends[name]

        return run

    ms = alternating_step_ms(
        dict.fromkeys(backends, core.step),
        rounds,
        steps=1,
        before={n: prepare(n) for n in backends},
    )
    core.abort_requests(added)
    model.backend = backends["kernel"]
    return {"dtype": dtype, "ms": ms, "torch_path_over_kernel": ms["torch_path"] / ms["kernel"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--name", default="prefill_attention")
    args = parser.parse_args()
    layer = []
    for dtype in (torch.bfloat16, torch.float32):
        for step in STEPS:
            row = {"dtype": str(dtype).removeprefix("torch."), "step": step}
            row |= layer_milliseconds(step, dtype, args.rounds)
            layer.append(row)
            print(f"layer: {row}", flush=True)
    report = {
        "threads": torch.get_num_threads(),
        "layer": layer,
        "step": step_milliseconds(args.dtype, args.rounds),
    }
    print(f"step: {report['step']}", flush=True)
    write_json(RESULTS / f"{args.name}.json", report, script_command(__file__))


if __name__ == "__main__":
    main()
