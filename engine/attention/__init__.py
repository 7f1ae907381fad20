"""Attention backends: which kernels a model runs, chosen once from the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmpool.engine import ops
from llmpool.engine.attention import torch_backend
from llmpool.engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "Backend", "select_backend"]


@dataclass(frozen=True)
class Backend:
    """The kernels of one implementation; every field has the torch reference's signature."""

    name: str
    plan: Callable[[AttentionMetadata], Any]
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]


TORCH = Backend(
    name="torch",
    plan=torch_backend.plan,
    write_kv=torch_backend.write_kv,
    paged_attention=torch_backend.paged_attention,
    rms_norm=ops.rms_norm,
    fused_add_rms_norm=ops.fused_add_rms_norm,
    rotary_embedding=ops.rotary_embedding,
)


def select_backend(device: torch.device, name: str = "auto") -> Backend:
    """``auto`` picks Triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TORCH
    if name == "triton":
        from llmpool.engine.attention.triton_backend import TRITON

        return TRITON
    raise ValueError(f"unknown attention backend {name!r}; expected auto, torch or triton")
