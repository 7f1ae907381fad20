"""Applying adapters to a flat batch: each row adds ``scaling · B(A·x)`` of its adapter's slot.

The rows of one step are grouped by slot once (:class:`LoraBatch`, built by the model runner);
rows of the base model are in no group and get nothing. On decode steps the torch path multiplies
every row by all slots' A in one GEMM, keeps each row's own slot (a one-hot mask) and multiplies
that by all slots' B in one GEMM per part: a few GEMMs per module whatever the adapters in the
step, reading each slot's weights once through the model's own GEMM choice (``linear``); what it
computes for other slots is small beside the base model's GEMMs at decode sizes. Gathering each
group's weights or scattering rows back with ``index_add_`` cost far more on CPU (bf16
``index_add_`` alone took 4 ms a call). Steps with long groups (prefill) go group by group. The Triton path (``kernels/lora.py``) reads the groups as they are.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llmpool.engine.models.linear import TORCH_GEMMS, GemmChoice, linear

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
class LoraWeights:
    """One fused module's adapter slots, as every backend's ``lora_add`` takes them: ``a``
    ``[S, len(b) · R, in]``, each ``b[j]`` ``[S, out_j, R]`` (the manager lays it out as
    ``[out_j, S, R]`` in memory, so that it is one ``[out_j, S · R]`` weight without a copy), and
    where each part's outputs start in the module's output."""

    a: torch.Tensor
    b: Sequence[torch.Tensor]
    offsets: Sequence[int]


# From this many rows in the step's largest group (prefill chunks), the torch path multiplies
# each group by its own slot's weights: the GEMMs against every slot would waste (S - 1)/S of
# their work on long prompts, while a decode step's few rows per adapter are cheaper in the
# few GEMMs against all slots than in a handful of small GEMMs per adapter.
GROUPED_MIN_ROWS = 16


@dataclass(frozen=True)
class TorchLoraPlan:
    token_slots: torch.Tensor  # as LoraBatch's
    row_scale: torch.Tensor  # float32 [T, 1]: the scaling of each row's adapter, 0 on base rows
    sorted_tokens: torch.Tensor  # as LoraBatch's
    # Against every slot: [T, S, 1, 1], each row's scale at its slot, 0 elsewhere and on base rows.
    own_slot: torch.Tensor | None
    # Group by group: (slot, start, end) of each group in sorted_tokens.
    groups: tuple[tuple[int, int, int], ...] | None


def torch_lora_plan(batch: LoraBatch, scaling: torch.Tensor) -> TorchLoraPlan:
    slots = batch.token_slots
    row_scale = torch.where(slots >= 0, scaling[slots.clamp(min=0)], 0.0).unsqueeze(-1)
    if batch.max_group_len >= GROUPED_MIN_ROWS:
        starts = batch.group_starts.tolist()
        groups = tuple(zip(batch.group_slots.tolist(), starts[:-1], starts[1:], strict=True))
        return TorchLoraPlan(slots, row_scale, batch.sorted_tokens, None, groups)
    own_slot = slots[:, None] == torch.arange(scaling.numel(), device=slots.device)[None, :]
    own_slot = (own_slot * row_scale)[:, :, None, None]
    return TorchLoraPlan(slots, row_scale, batch.sorted_tokens, own_slot, None)


def torch_lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    weights: LoraWeights,
    plan: TorchLoraPlan,
    gemm: GemmChoice = TORCH_GEMMS,
) -> None:
    """``out[t, off_j : off_j + out_j] += scale · (x[t] · A[slot, jR:(j+1)R]ᵀ) · B_j[slot]ᵀ``
    for every row ``t`` with an adapter (:class:`LoraWeights`); ``gemm``: the model's GEMM
    choice."""
    if plan.groups is not None:
        _add_by_group(out, x, weights, plan, plan.groups)
        return
    assert plan.own_slot is not None
    a, b, offsets = weights.a, weights.b, weights.offsets
    num_slots, parts_rank, in_features = a.shape
    num_rows, num_parts = x.shape[0], len(b)
    rank = parts_rank // num_parts
    shrunk = linear(x, a.view(num_slots * parts_rank, in_features), gemm=gemm)
    # Each row keeps its own slot's values, times its scale (exact for the power-of-two
    # alpha/r of usual adapters; otherwise it differs from scaling B's output by rounding).
    mine = shrunk.view(num_rows, num_slots, num_parts, rank) * plan.own_slot.to(x.dtype)
    for j, (b_j, offset) in enumerate(zip(b, offsets, strict=True)):
        weight = b_j.permute(1, 0, 2).reshape(b_j.shape[1], num_slots * rank)
        part = mine[:, :, j, :].reshape(num_rows, num_slots * rank)
        out[:, offset : offset + b_j.shape[1]] += linear(part, weight, gemm=gemm)


def _add_by_group(
    out: torch.Tensor,
    x: torch.Tensor,
    weights: LoraWeights,
    plan: TorchLoraPlan,
    groups: tuple[tuple[int, int, int], ...],
) -> None:
    a, b, offsets = weights.a, weights.b, weights.offsets
    rows = plan.sorted_tokens
    grouped_x = x.index_select(0, rows)
    scale = plan.row_scale.index_select(0, rows).to(out.dtype)
    rank = a.shape[1] // len(b)
    shrunk = x.new_empty(rows.numel(), a.shape[1])
    for slot, start, end in groups:
        torch.mm(grouped_x[start:end], a[slot].t(), out=shrunk[start:end])
    for j, (b_j, offset) in enumerate(zip(b, offsets, strict=True)):
        delta = out.new_empty(rows.numel(), b_j.shape[1])
        for slot, start, end in groups:
            part = shrunk[start:end, j * rank : (j + 1) * rank]
            torch.mm(part, b_j[slot].t(), out=delta[start:end])
        unsorted = out.new_zeros(out.shape[0], b_j.shape[1])
        unsorted.index_copy_(0, rows, delta.mul_(scale))
        out[:, offset : offset + b_j.shape[1]] += unsorted


@dataclass(frozen=True)
class _Step:
    backend: Backend
    stacks: LoraStacks
    plan: Any


class _Current(threading.local):
    """The step each thread runs, as in ``attention/step.py``."""

    step: _Step | None = None


_current = _Current()


@contextlib.contextmanager
def step_lora(
    backend: Backend, stacks: LoraStacks | None, batch: LoraBatch | None
) -> Iterator[None]:
    """Plan the step's adapter groups once; :func:`lora_add` inside uses the plan. Without a
    batch (a step of base-model rows only) every :func:`lora_add` is a no-op."""
    previous = _current.step
    _current.step = None
    if stacks is not None and batch is not None:
        _current.step = _Step(backend, stacks, backend.lora_plan(batch, stacks.scaling))
    try:
        yield
    finally:
        _current.step = previous


def lora_add(out: torch.Tensor, x: torch.Tensor, layer: int, module: int) -> None:
    """Add the step's adapter deltas of ``module`` (``lora.QKV`` ...) of ``layer`` into ``out``."""
    step = _current.step
    if step is None:
        return
    stacks = step.stacks
    weights = LoraWeights(stacks.a[layer][module], stacks.b[layer][module], stacks.offsets[module])
    step.backend.lora_add(out, x, weights, step.plan)
