"""Timing engine steps and their GEMMs, the way the kernel and decode-step benchmarks compare
two or more ways of doing the same work.

Ways are alternated round by round (never all rounds of one, then all of the other) so that load
from outside the run falls on every way alike; each reports its median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from llmpool.bench.launch import build_in_ended_thread
from llmpool.engine import LLM, SamplingParams
from llmpool.engine.attention import AttentionMetadata
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.kernels.capabilities import KernelCapabilities
from llmpool.engine.models.llama import LlamaForCausalLM

CONTEXT = (40, 700)  # tokens of context per decoding request in the kernel benchmarks
ENDLESS = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)

Operand = TypeVar("Operand")


def gemm_weights(model: LlamaForCausalLM) -> list[torch.Tensor]:
    """The weights of every GEMM of a step, in order (the dense ones: unquantized models)."""
    weights = []
    for layer in model.layers:
        for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            weights.append(proj.weight)
    weights.append(model.lm_head)
    return weights


def layer_by_layer(model: LlamaForCausalLM, kernels: KernelCapabilities) -> None:
    """``model.use_kernels(kernels)`` with every step run layer by layer (no C decoder): how
    the kernel benchmarks compare one kernel against another inside a layer."""
    model.use_kernels(kernels)
    model.cpu_decoder = None


def random_prompts(concurrency: int) -> list[list[int]]:
    """``concurrency`` prompts of random token ids, ``CONTEXT`` tokens long, seeded by it."""
    rng = random.Random(concurrency)
    return [
        [rng.randrange(100, 40_000) for _ in range(rng.randint(*CONTEXT))]
        for _ in range(concurrency)
    ]


def paged_batch(
    seq_lens: Sequence[int], query_lens: Sequence[int], block_size: int, seed: int
) -> AttentionMetadata:
    """One step's metadata for sequences of ``seq_lens`` tokens whose last ``query_lens`` are
    this step's queries, their blocks a random permutation of one pool."""
    blocks = [-(-n // block_size) for n in seq_lens]
    physical = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(seed))
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = physical[start : start + count]
        start += count
    query_start_loc = [0]
    for query_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)
    return AttentionMetadata(
        slot_mapping=torch.zeros(query_start_loc[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


def start_decoding(
    core: EngineCore, ids: Sequence[str], prompts: Sequence[list[int]], params: SamplingParams
) -> None:
    """Add one request per id and step until every one has finished its prompt."""
    for request_id, prompt in zip(ids, prompts, strict=True):
        core.add_request(request_id, prompt, params)
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()


def alternating_step_ms(
    steppers: Mapping[str, Callable[[], object]],
    rounds: int,
    steps: int,
    before: Mapping[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Median ms per step of each stepper: ``rounds`` rounds, each running every stepper
    ``steps`` times in turn (after its untimed ``before``, if any)."""
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, step in steppers.items():
            if before:
                before[name]()
            started = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - started) / steps * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def engine_for_alternating(
    description: str, name: str, concurrency: list[int]
) -> tuple[argparse.Namespace, LLM]:
    """The command line of a benchmark that alternates ways of stepping one engine
    (``--concurrency``, ``--dtype``, ``--quantization``, ``--rounds``, ``--name``), and the
    engine it names, built in a thread that has ended (``launch.build_in_ended_thread``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--concurrency", nargs="+", type=int, default=concurrency)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--name", default=name)
    args = parser.parse_args()
    llm = build_in_ended_thread(
        lambda: LLM(dtype=args.dtype, quantization=args.quantization, enable_prefix_caching=False)
    )
    return args, llm


def alternate_steps(
    llm: LLM, concurrencies: list[int], rounds: int, choices: dict[str, Callable[[], None]]
) -> list[dict[str, Any]]:
    """Median step time of ``llm`` at each concurrency under each of ``choices`` (name ->
    what switches to it), rounds of 4 steps alternating between them; the first choice is
    left on."""
    core = llm.engine
    first, second = choices
    rows = []
    for concurrency in concurrencies:
        ids = [f"{concurrency}-{index}" for index in range(concurrency)]
        start_decoding(core, ids, random_prompts(concurrency), ENDLESS)
        medians = alternating_step_ms(
            {name: core.step for name in choices}, rounds, steps=4, before=choices
        )
        core.abort_requests(ids)
        rows.append(
            {
                "concurrency": concurrency,
                "step_ms": medians,
                f"{second}_over_{first}": medians[second] / medians[first],
            }
        )
        print(f"step c={concurrency}: {rows[-1]}", flush=True)
    choices[first]()
    return rows


def gemm_ms(
    operands: Sequence[Operand],
    ways: dict[str, Callable[[torch.Tensor, Operand], object]],
    input_for: Callable[[Operand], torch.Tensor],
    rounds: int,
) -> dict[str, float]:
    """Median ms of each way run over every operand in turn (``way(input_for(op), op)``),
    ``rounds`` rounds alternating between ways after one that warms up."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        for _ in range(rounds + 1):
            for name, way in ways.items():
                started = time.perf_counter()
                for operand in operands:
                    way(input_for(operand), operand)
                times[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def per_dtype(
    key: str, sizes: Sequence[int], measure: Callable[[int, torch.dtype], dict[str, Any]]
) -> list[dict[str, Any]]:
    """``measure(size, dtype)`` for bfloat16 then float32 at each size, one row each (labelled
    ``dtype`` and ``key``), printed as it comes."""
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for size in sizes:
            row = {"dtype": str(dtype).removeprefix("torch."), key: size} | measure(size, dtype)
            rows.append(row)
            print(f"{key} {size}: {row}", flush=True)
    return rows
