"""The roof `llmpool bench serve --roof` reports: the model's work counted from its real files."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from safetensors import safe_open

from llmpool.bench import roof
from llmpool.bench.roof import (
    BANDWIDTH_BYTES,
    MachineRoof,
    ModelShape,
    measure_machine,
    workload_roof,
)
from llmpool.bench.serve import RequestResult, parse_args, summarize
from llmpool.engine import huge_pages
from llmpool.engine.model_source import resolve

MACHINE = MachineRoof(
    dtype="bfloat16", gemm_gflops=100.0, read_gbytes_per_s=10.0, gemm_dtype="bfloat16"
)


def builtin_shape() -> ModelShape:
    return ModelShape.from_folder(resolve(None).folder)


def test_the_counted_parameters_are_the_model_files_less_norms_and_the_tied_embedding() -> None:
    folder = resolve(None).folder
    with safe_open(folder / "model.safetensors", "pt") as weights:
        numels = {name: weights.get_slice(name).get_shape() for name in weights.keys()}  # noqa: SIM118
    matmul_params = sum(
        math.prod(shape)
        for name, shape in numels.items()
        if len(shape) == 2 and "embed" not in name
    )
    shape = builtin_shape()
    assert shape.layer_params == matmul_params
    embedding = next(s for name, s in numels.items() if "embed_tokens" in name)
    assert shape.head_params == math.prod(embedding)  # the tied LM head reads the embedding


def test_one_request_is_memory_bound_and_a_wide_batch_compute_bound() -> None:
    shape = builtin_shape()
    single = workload_roof(shape, MACHINE, [(100, 100)], concurrency=1)
    assert single.bound == "memory"
    weight_bytes = (shape.layer_params + shape.head_params) * 2
    assert single.gbytes * 1e9 >= 100 * weight_bytes  # one step per output token
    wide = workload_roof(shape, MACHINE, [(500, 100)] * 64, concurrency=64)
    assert wide.bound == "compute"
    assert math.isclose(wide.seconds, wide.gflop / MACHINE.gemm_gflops)


def test_steps_are_bounded_by_the_longest_output_and_by_the_concurrency() -> None:
    shape = builtin_shape()
    weights = (shape.layer_params + shape.head_params) * 2
    # One-token outputs read no context: the bytes are the weights, once per step.
    assert math.isclose(workload_roof(shape, MACHINE, [(0, 1)] * 8, 4).gbytes * 1e9, 2 * weights)
    # A 5-token output needs 5 steps however wide the batch, and reads 0+1+2+3+4 positions.
    assert math.isclose(
        workload_roof(shape, MACHINE, [(0, 1)] * 7 + [(0, 5)], 64).gbytes * 1e9,
        5 * weights + 10 * shape.kv_bytes_per_position(2),
    )


def test_a_level_reports_its_fraction_of_the_roof() -> None:
    shape = builtin_shape()
    done = [RequestResult(ok=True, output_tokens=16, prompt_tokens=64) for _ in range(4)]
    level = summarize(4, done, duration=2.0, roof=(shape, MACHINE))
    expected = workload_roof(shape, MACHINE, [(64, 16)] * 4, 4).seconds
    assert level.roof_s == expected
    assert level.fraction_of_roof == expected / 2.0
    uncounted = [*done, RequestResult(ok=True, output_tokens=16)]
    assert math.isnan(summarize(4, uncounted, 2.0, (shape, MACHINE)).fraction_of_roof)
    assert math.isnan(summarize(4, done, 2.0).fraction_of_roof)


def test_roof_defaults_to_the_builtin_model_in_the_servers_dtype() -> None:
    args = parse_args(["--roof", "--roof-dtype", "float32"])
    assert args.roof == builtin_shape()
    assert args.roof_dtype == "float32"
    assert parse_args([]).roof is None


def test_the_machine_is_measured_over_operands_in_huge_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GEMM operands and the bandwidth buffer come from ``huge_pages.zeros``, as the
    engine's weights and KV cache do; the rates are positive and finite."""
    allocated: list[tuple[int, ...]] = []

    def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        allocated.append(tuple(shape))
        return original(shape, dtype)

    original = huge_pages.zeros
    monkeypatch.setattr(huge_pages, "zeros", zeros)
    machine = measure_machine(builtin_shape(), "float32", repeats=1, rounds=1)
    assert 0 < machine.gemm_gflops < math.inf and 0 < machine.read_gbytes_per_s < math.inf
    assert (BANDWIDTH_BYTES // 4,) in allocated
    assert (builtin_shape().vocab, builtin_shape().hidden) in allocated


def test_the_machine_rates_are_the_best_of_their_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A roof is what the machine can do: a slow round (an AMX Xeon measured 292 GFLOP/s in one
    round and 969 in the next) does not lower it, for either rate."""
    rounds = iter(
        [
            ({"bfloat16": 292.0, "float32": 200.0}, 29.0),
            ({"bfloat16": 969.0, "float32": 210.0}, 28.0),
            ({"bfloat16": 498.0, "float32": 205.0}, 29.5),
        ]
    )
    monkeypatch.setattr(roof, "_measure_round", lambda shape, dtypes, repeats: next(rounds))
    machine = measure_machine(builtin_shape(), "bfloat16", rounds=3)
    assert machine == MachineRoof(
        "bfloat16", gemm_gflops=969.0, read_gbytes_per_s=29.5, gemm_dtype="bfloat16"
    )


def test_float32_gemms_set_the_rate_where_they_run_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AMX the engine runs large bfloat16 batches in float32 where its probe finds that
    faster (an AVX-512 BF16 Xeon: 1.45x), so the roof counts the faster rate and says which;
    the bytes stay the served dtype's."""
    asked = []

    def measure_round(shape: ModelShape, dtypes: list[str], repeats: int) -> tuple[dict, float]:
        asked.append(list(dtypes))
        return {"bfloat16": 155.0, "float32": 225.0}, 29.0

    monkeypatch.setattr(roof, "_measure_round", measure_round)
    machine = measure_machine(builtin_shape(), "bfloat16", rounds=2)
    assert asked == [["bfloat16", "float32"]] * 2
    assert machine == MachineRoof("bfloat16", 225.0, 29.0, gemm_dtype="float32")
    assert measure_machine(builtin_shape(), "float32", rounds=1).gemm_dtype == "float32"
    assert asked[-1] == ["float32"]
