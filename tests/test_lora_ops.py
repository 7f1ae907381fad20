"""The torch LoRA op (the reference the Triton kernel is tested against) against a per-row loop,
both ways it runs: against every slot (decode steps) and group by group (long groups)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from llmpool.engine.lora import ops
from llmpool.engine.lora.ops import torch_lora_add, torch_lora_plan


@pytest.mark.parametrize("grouped_min_rows", [1, 1000], ids=["group-by-group", "every-slot"])
def test_torch_lora_add_matches_a_loop_over_rows(
    lora_case: Callable[..., Any], grouped_min_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ranks 8 (slot 2) and 16 in stacks of rank 16; 3 groups out of slot order, base rows between.
    monkeypatch.setattr(ops, "GROUPED_MIN_ROWS", grouped_min_rows)
    case = lora_case(16, torch.float32, torch.device("cpu"))
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

    actual = case.out.clone()
    plan = torch_lora_plan(case.batch, case.scaling)
    assert (plan.groups is not None) == (grouped_min_rows == 1)
    torch_lora_add(actual, case.x, case.a, case.b, case.offsets, plan)

    torch.testing.assert_close(actual, expected.float(), atol=1e-5, rtol=1e-5)
    base_rows = [row for row, slot in enumerate(case.row_slots) if slot < 0]
    assert len(base_rows) == 7
    assert torch.equal(actual[base_rows], case.out[base_rows])
    assert not torch.allclose(actual, case.out)  # the deltas are not negligible
