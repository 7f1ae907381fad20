"""The torch LoRA op (the reference the Triton kernel is tested against) against a per-row loop,
both ways it runs: against every slot (decode steps) and group by group (long groups); the CPU
backend's C kernel against the same loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from llmpool.engine.kernels import cpu_lora
from llmpool.engine.lora import ops
from llmpool.engine.lora.ops import torch_lora_add, torch_lora_plan
from llmpool.engine.models.linear import TORCH_GEMMS


@pytest.mark.parametrize("grouped_min_rows", [1, 1000], ids=["group-by-group", "every-slot"])
def test_torch_lora_add_matches_a_loop_over_rows(
    lora_case: Callable[..., Any], grouped_min_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ranks 8 (slot 2) and 16 in stacks of rank 16; 3 groups out of slot order, base rows between.
    monkeypatch.setattr(ops, "GROUPED_MIN_ROWS", grouped_min_rows)
    case = lora_case(16, torch.float32, torch.device("cpu"))
    actual = case.out.clone()
    plan = torch_lora_plan(case.batch, case.scaling)
    assert (plan.groups is not None) == (grouped_min_rows == 1)
    torch_lora_add(actual, case.x, case.weights, plan)

    torch.testing.assert_close(actual, row_by_row(case).float(), atol=1e-5, rtol=1e-5)
    assert_base_rows_untouched(case, actual)


@pytest.mark.parametrize(
    ("max_rank", "in_features", "out_parts"),
    [(16, 48, (32, 16, 16)), (24, 50, (37, 16, 70)), (8, 576, (576, 192, 192))],
    ids=["rank16", "tails", "smollm2-qkv-rank8"],
)
def test_cpu_kernel_matches_a_loop_over_rows(
    lora_case: Callable[..., Any],
    max_rank: int,
    in_features: int,
    out_parts: tuple[int, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # bfloat16 operands in the manager's [out, S, R] layout of B; tails of every loop: ranks
    # not a multiple of 16 (24, and 12 in slot 2), inputs of 50, parts of 37 and 70 outputs.
    assert cpu_lora.KERNEL.available
    monkeypatch.setattr(
        ops, "GROUPED_MIN_ROWS", 1000
    )  # a decode step's plan (its largest group: 17)
    case = lora_case(max_rank, torch.bfloat16, torch.device("cpu"), in_features, out_parts)
    weights = case.weights_as_the_manager_lays_them_out()
    actual = case.out.clone()
    plan = torch_lora_plan(case.batch, case.scaling)
    assert plan.groups is None
    assert cpu_lora.unsupported(actual, case.x, weights) is None
    cpu_lora.kernel_lora_add(actual, case.x, weights, plan)

    # float32 sums of exact bfloat16 products, then one rounding to bfloat16.
    expected = row_by_row(case)
    torch.testing.assert_close(actual.double(), expected, atol=1e-2, rtol=2**-7)
    assert_base_rows_untouched(case, actual)

    # The backend's entry point takes the kernel for decode steps, the torch op for long groups.
    through_backend = case.out.clone()
    cpu_lora.cpu_lora_add(through_backend, case.x, weights, plan, TORCH_GEMMS)
    assert torch.equal(through_backend, actual)
    monkeypatch.setattr(ops, "GROUPED_MIN_ROWS", 1)
    grouped = torch_lora_plan(case.batch, case.scaling)
    by_torch, through_backend = case.out.clone(), case.out.clone()
    torch_lora_add(by_torch, case.x, weights, grouped)
    cpu_lora.cpu_lora_add(through_backend, case.x, weights, grouped, TORCH_GEMMS)
    assert torch.equal(through_backend, by_torch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_lora_add_in_other_dtypes(
    lora_case: Callable[..., Any], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # float32 in the kernel, float16 (which it does not take) in the torch op.
    monkeypatch.setattr(ops, "GROUPED_MIN_ROWS", 1000)
    case = lora_case(24, dtype, torch.device("cpu"), 50, (37, 16, 70))
    weights = case.weights_as_the_manager_lays_them_out()
    actual = case.out.clone()
    plan = torch_lora_plan(case.batch, case.scaling)
    cpu_lora.cpu_lora_add(actual, case.x, weights, plan, TORCH_GEMMS)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.double(), row_by_row(case), atol=tolerance, rtol=tolerance)
    assert_base_rows_untouched(case, actual)


def row_by_row(case: Any) -> torch.Tensor:
    """``case.out`` plus each row's adapter delta, in float64, one row at a time."""
    rank = case.a.shape[1] // len(case.b)
    expected = case.out.double()
    for row, slot in enumerate(case.row_slots):
        if slot < 0:
            continue
        r = case.ranks[slot]
        for j, (b_j, offset) in enumerate(zip(case.b, case.offsets, strict=True)):
            a_j = case.a[slot, j * rank : j * rank + r].double()
            delta = (case.x[row].double() @ a_j.T) @ b_j[slot, :, :r].double().T
            expected[row, offset : offset + b_j.shape[1]] += float(case.scaling[slot]) * delta
    return expected


def assert_base_rows_untouched(case: Any, actual: torch.Tensor) -> None:
    base_rows = [row for row, slot in enumerate(case.row_slots) if slot < 0]
    assert len(base_rows) == 7
    assert torch.equal(actual[base_rows], case.out[base_rows])
    assert not torch.allclose(actual, case.out)  # the deltas are not negligible
