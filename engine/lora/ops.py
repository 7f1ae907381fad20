"""Applying adapters to a flat batch: each row adds ``scaling · B(A·x)`` of its adapter's slot.

Rows are grouped by slot once per step (:class:`LoraBatch`, built by the model runner); rows of
the base model are in no group and get nothing. The torch path pads the groups to one length
and runs one batched matmul per module part, so its op count does not grow with the number of
adapters in the step (a loop over adapters would). The Triton path (``kernels/lora.py``) reads
the groups as they are. PEFT's order is kept: the scale multiplies B's output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from llmpool.engine.attention import Backend
    from llmpool.engine.lora.manager import LoraStacks


@dataclass(frozen=True)
class LoraBatch:
    """The rows of one step that use an adapter, grouped by the adapter's slot."""

    sorted_tokens: torch.Tensor  # int64 [n]: rows of the flat batch, group after group
    group_slots: torch.Tensor  # int64 [G]: each group's slot
    group_starts: torch.Tensor  # int64 [G + 1]: where each group starts in sorted_tokens
    max_group_len: int


@dataclass(frozen=True)
class TorchLoraPlan:
    """The groups padded to ``max_group_len`` rows: pads read row 0 and add zero."""

    gather: torch.Tensor  # int64 [G * L]: the row each padded position reads
    slots: torch.Tensor  # int64 [G]
    scale: torch.Tensor  # [G, L, 1]: the group's scaling, 0 on pads
    num_groups: int
    group_len: int


def torch_lora_plan(batch: LoraBatch, scaling: torch.Tensor) -> TorchLoraPlan:
    starts = batch.group_starts
    lengths = starts[1:] - starts[:-1]
    num_groups, group_len = lengths.numel(), batch.max_group_len
    offsets = torch.arange(group_len, device=starts.device)
    valid = offsets[None, :] < lengths[:, None]  # [G, L]
    index = (starts[:-1, None] + offsets[None, :]).clamp(
        max=max(batch.sorted_tokens.numel() - 1, 0)
    )
    gather = torch.where(valid, batch.sorted_tokens[index], 0).reshape(-1)
    scale = (scaling[batch.group_slots][:, None] * valid).unsqueeze(-1)
    return TorchLoraPlan(gather, batch.group_slots, scale, num_groups, group_len)


def torch_lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: Sequence[torch.Tensor],
    offsets: Sequence[int],
    plan: TorchLoraPlan,
) -> None:
    """``out[t, off_j : off_j + out_j] += scale · (x[t] · A[slot, jR:(j+1)R]ᵀ) · B_j[slot]ᵀ``
    for every row ``t`` in a group; ``a`` is ``[S, len(b) · R, in]``, each ``b[j]``
    ``[S, out_j, R]``."""
    groups, length = plan.num_groups, plan.group_len
    rank = a.shape[1] // len(b)
    rows = x.index_select(0, plan.gather).view(groups, length, -1)
    shrunk = torch.bmm(rows, a.index_select(0, plan.slots).mT)  # [G, L, n · R]
    scale = plan.scale.to(out.dtype)
    for j, (b_j, offset) in enumerate(zip(b, offsets, strict=True)):
        delta = torch.bmm(
            shrunk[..., j * rank : (j + 1) * rank], b_j.index_select(0, plan.slots).mT
        )
        delta = (delta * scale).view(groups * length, -1)
        part = out[:, offset : offset + b_j.shape[1]]
        # Pads add zero to row 0, so index_add_ over all padded positions is exact.
        part.index_add_(0, plan.gather, delta)


@dataclass(frozen=True)
class _Step:
    backend: Backend
    stacks: LoraStacks
    plan: Any


_current: _Step | None = None


@contextlib.contextmanager
def step_lora(
    backend: Backend, stacks: LoraStacks | None, batch: LoraBatch | None
) -> Iterator[None]:
    """Plan the step's adapter groups once; :func:`lora_add` inside uses the plan. Without a
    batch (a step of base-model rows only) every :func:`lora_add` is a no-op."""
    global _current
    previous = _current
    _current = None
    if stacks is not None and batch is not None:
        _current = _Step(backend, stacks, backend.lora_plan(batch, stacks.scaling))
    try:
        yield
    finally:
        _current = previous


def lora_add(out: torch.Tensor, x: torch.Tensor, layer: int, module: int) -> None:
    """Add the step's adapter deltas of ``module`` (``lora.QKV`` ...) of ``layer`` into ``out``."""
    step = _current
    if step is None:
        return
    stacks = step.stacks
    step.backend.lora_add(
        out, x, stacks.a[layer][module], stacks.b[layer][module], stacks.offsets[module], step.plan
    )
