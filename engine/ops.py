"""Reference torch implementations of the small fused ops of a Llama layer (RMSNorm, rotary,
SiLU-and-mul)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, exactly as transformers' LlamaRMSNorm."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``: the residual add folded into the norm."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` ``[T, heads, D]`` and ``key`` ``[T, kv_heads, D]`` (neox / rotate-half style).

    ``cos_sin_cache`` is ``[max_positions, D]``: cosines in the first half, sines in the second.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(query.dtype)
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(query.dtype)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, ``gate`` and ``up`` the two halves of the last dimension (the fused
    gate/up projection's output)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
