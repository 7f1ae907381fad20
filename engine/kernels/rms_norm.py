"""Triton RMSNorm, alone and with the residual add fused in, rounding like the torch reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    x_stride,
    residual_stride,
    out_stride,
    new_residual_stride,
    hidden,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row. The sum and the normalized row are rounded to their storage dtypes
    at the same points as the reference, so fp16/bf16 results match it bit for bit or nearly."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = x + residual.to(tl.float32)
        x_rounded = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * new_residual_stride + cols, x_rounded, mask=mask)
        x = x_rounded.to(tl.float32)
    # new_residual_ptr always has the dtype of the normalized input (it is x when not adding).
    variance = tl.sum(x * x, 0) / hidden
    normed = (x * tl.rsqrt(variance + eps)).to(new_residual_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * out_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask
    )


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    # The reference multiplies by the weight last, so the output takes the promoted dtype.
    new_residual = None
    if residual is None:
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        residual_rows = rows
    else:
        residual_rows = residual.reshape(-1, hidden)
        new_residual = torch.empty(
            rows.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device
        )
        out_dtype = torch.promote_types(weight.dtype, new_residual.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0] > 0:
        if rows.stride(-1) != 1 or residual_rows.stride(-1) != 1 or weight.stride(-1) != 1:
            raise ValueError("rms_norm needs the hidden dimension to be contiguous")
        # Without a residual the kernel only reads this pointer's dtype, never writes it.
        written_residual = new_residual if new_residual is not None else rows
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            residual_rows,
            weight,
            out,
            written_residual,
            rows.stride(0),
            residual_rows.stride(0),
            out.stride(0),
            written_residual.stride(0),
            hidden,
            eps,
            ADD_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    out = out.view(x.shape)
    return out, None if new_residual is None else new_residual.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32 (as transformers' LlamaRMSNorm)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)`` from one read of each input."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
