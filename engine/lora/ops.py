"""Applying adapters to a flat batch: each row adds ``scaling · B(A·x)`` of its adapter's slot.

The rows of one step are grouped by slot once (:class:`LoraBatch`, built by the model runner);
rows of the base model are in no group and get nothing. The torch path multiplies every row by
all slots' A in one GEMM, keeps each row's own slot (a one-hot mask) and multiplies that by all
slots' B in one GEMM per part: a few GEMMs per module whatever the adapters in the step, which
read each slot's weights once and go through the model's own GEMM choice (``linear``). What it
computes for other slots is small beside the base model's GEMMs at LoRA ranks; gathering each
group's weights or scattering its rows back cost far more on CPU (bf16 ``index_add_`` alone was
4 ms a call). The Triton path (``kernels/lora.py``) reads the groups as they are. PEFT's order is
kept: the scale multiplies B's output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llmpool.engine.models.linear import linear

if TYPE_CHECKING:
    from llmpool.engine.attention import Backend
    from llmpool.engine.lora.manager import LoraStacks


@dataclass(frozen=True)
class LoraBatch:
    """The rows of one step that use an adapter, grouped by the adapter's slot."""

    token_slots: torch.Tensor  # int64 [T]: each row's slot, -1 for the base model
    sorted_tokens: torch.Tensor  # int64 [n]: rows of the flat batch, group after group
    group_slots: torch.Tensor  # int64 [G]: each group's slot
    group_starts: torch.Tensor  # int64 [G + 1]: where each group starts in sorted_tokens
    max_group_len: int


@dataclass(frozen=True)
class TorchLoraPlan:
    own_slot: torch.Tensor  # [T, S, 1]: 1 at each row's slot, 0 elsewhere and on base rows
    row_scale: torch.Tensor  # float32 [T, 1]: the scaling of each row's adapter, 0 on base rows


def torch_lora_plan(batch: LoraBatch, scaling: torch.Tensor) -> TorchLoraPlan:
    slots = batch.token_slots
    own_slot = slots[:, None] == torch.arange(scaling.numel(), device=slots.device)[None, :]
    row_scale = torch.where(slots >= 0, scaling[slots.clamp(min=0)], 0.0)
    return TorchLoraPlan(own_slot.unsqueeze(-1), row_scale.unsqueeze(-1))


def torch_lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: Sequence[torch.Tensor],
    offsets: Sequence[int],
    plan: TorchLoraPlan,
) -> None:
    """``out[t, off_j : off_j + out_j] += scale · (x[t] · A[slot, jR:(j+1)R]ᵀ) · B_j[slot]ᵀ``
    for every row ``t`` with an adapter; ``a`` is ``[S, len(b) · R, in]``, each ``b[j]``
    ``[S, out_j, R]`` (the manager lays it out as ``[out_j, S, R]`` in memory, so that it is one
    ``[out_j, S · R]`` weight without a copy)."""
    num_slots, parts_rank, in_features = a.shape
    num_rows, rank = x.shape[0], parts_rank // len(b)
    shrunk = linear(x, a.view(num_slots * parts_rank, in_features))
    shrunk = shrunk.view(num_rows, num_slots, len(b), rank)
    own_slot = plan.own_slot.to(x.dtype)
    for j, (b_j, offset) in enumerate(zip(b, offsets, strict=True)):
        mine = (shrunk[:, :, j, :] * own_slot).view(num_rows, num_slots * rank)
        weight = b_j.permute(1, 0, 2).reshape(b_j.shape[1], num_slots * rank)
        delta = linear(mine, weight) * plan.row_scale.to(out.dtype)
        out[:, offset : offset + b_j.shape[1]] += delta


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
