"""Linear layers that pick the faster GEMM orientation for small float32 batches on CPU."""

from __future__ import annotations

import torch
from torch import nn

# Up to this many rows, W·xᵀ beats x·Wᵀ in float32 on CPU (MKL on 2 threads, SmolLM2's layer
# shapes: 1.9x at 16 rows, 1.1x at 64, slower from about 96 rows, where prefill batches live).
# bfloat16 goes through oneDNN, where the plain orientation is already the faster one.
CPU_TRANSPOSED_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``.

    Decode batches are a few rows against a large weight. On one thread both orientations take
    the same time; on two, MKL's split of x·Wᵀ with few rows barely gains, while W·xᵀ has the
    weight's many rows to split, so each thread streams half of the weight.
    """
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[0] > CPU_TRANSPOSED_MAX_ROWS
    ):
        return nn.functional.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """``nn.Linear`` computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
