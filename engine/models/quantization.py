"""Quantization: int8 weight-only layers (per-output-channel scales) and the fp8 (e4m3) KV cache."""

from __future__ import annotations

import torch
from torch import nn

INT8_MAX = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``weight ≈ q * scale[:, None]``, each row's largest value to 127."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-8) / INT8_MAX
    quantized = torch.round(weight / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantized, scale


class Int8Linear(nn.Module):
    """``y = (x @ q.T) * scale + bias``, with the weight stored as int8 and one scale per output.

    Buffers, not parameters: ``module.to(dtype)`` then casts the scales and bias but leaves the
    int8 weight alone.
    """

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        quantized, scale = quantize_rows_int8(weight)
        return cls(quantized, scale, None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            # A fused CPU kernel that never materializes the dequantized weight.
            out = torch._weight_int8pack_mm(x, self.weight, self.scale.to(x.dtype))
        else:
            out = nn.functional.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one scale per row (per token)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, token_ids)
        scale = self.scale.index_select(0, token_ids)
        return rows.to(scale.dtype) * scale[:, None]


def quantize_int8(model: nn.Module) -> None:
    """Replace every Linear of the decoder layers, the embeddings and the LM head by int8 ones.

    A tied LM head keeps sharing the embedding's int8 table: per-row scales of the embedding are
    exactly per-output-channel scales of the head.
    """
    for layer in model.layers:
        for name, child in list(layer.named_children()):
            if isinstance(child, nn.Linear):
                setattr(layer, name, Int8Linear.from_float(child.weight, child.bias))
    embedding_weight, embedding_scale = quantize_rows_int8(model.embed_tokens.weight)
    model.embed_tokens = Int8Embedding(embedding_weight, embedding_scale)
    if model.shape.tie_word_embeddings:
        lm_head = Int8Linear(embedding_weight, embedding_scale, None)
    else:
        lm_head = Int8Linear.from_float(model.lm_head)
    del model.lm_head  # a parameter until now; a module cannot take its name while it exists
    model.lm_head = lm_head


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each shared tensor counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at ±448: what an fp8 KV cache stores for ``x``.

    The division is a multiplication by the fp32 reciprocal, computed in fp32 whatever the
    dtype of ``x``, so that the Triton write kernel can reproduce every byte.
    """
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def check_kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Scales are for fp8 caches only; a cache in the model's dtype holds K and V as they are."""
    if cache_dtype != FP8_DTYPE and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(
            f"KV scales ({k_scale}, {v_scale}) apply to an fp8 cache only, not {cache_dtype}"
        )
