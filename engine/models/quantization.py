"""Weight quantization: int8 and int4 (models/int4.py) weight-only layers.

The fp8 (e4m3) KV cache is the KV cache's own (``engine/kv_cache.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmpool.engine.kernels import vnni_gemm
from llmpool.engine.kernels.capabilities import KernelCapabilities
from llmpool.engine.models.int4 import Int4Linear

if TYPE_CHECKING:  # the model's use_kernels re-sets this module's Int8Linear layers
    from llmpool.engine.models.llama import LlamaForCausalLM

INT8_MAX = 127


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``weight ≈ q * scale[:, None]``, each row's largest value to 127."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-8) / INT8_MAX
    quantized = torch.round(weight / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantized, scale


# Up to this many rows (decode batches), int8 layers on CPU run torch's fused weight-only kernel;
# above, the integer matmul of split activations (Int8Linear.forward). They cross between 4 and
# 16 rows on this project's CPU (one thread, SmolLM2's qkv: 82 vs 114 us at 4, 293 vs 172 at 16).
INT8_KERNEL_MAX_ROWS = 8
# Where ``vnni_gemm``'s kernels are built (AVX-512 VNNI and VBMI), up to this many rows run its
# int8 kernel instead, which computes int8_split_matmul's numbers: against torch's kernel 2.4x
# at one row on SmolLM2's int8 LM head and 1.2-2.0x on its layers; against the split matmul
# 1.1-1.4x at 16 rows, even at 32 and slower from 64 (python benchmarks/vnni_gemm.py).
INT8_VNNI_MAX_ROWS = 16
# Activations split into two int8 parts: x ≈ step * (high + low / INT8_SPLIT).
INT8_SPLIT = 2 * INT8_MAX


def int8_split_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` in float32 by one int8 x int8 -> int32 matmul.

    Each row of ``x`` is written as ``step * (high + low / 254)`` with int8 ``high`` and ``low``
    and ``step = amax / 127``: 15 bits per row, far finer than bfloat16's 8 (measured 3e-5 of
    the output's largest value against 4e-3 for the bfloat16 kernel). Both parts go through
    ``torch._int_mm`` stacked, which uses the CPU's int8 dot products (VNNI) at 2-4x the
    float32 matmul's rate. Not quantizing activations: per-token int8 alone (one part) cost
    the built-in model 3% perplexity and half its greedy agreement.
    """
    x = x.float()
    rows = x.shape[0]
    tiny = torch.finfo(torch.float32).tiny
    step = x.abs().amax(dim=1, keepdim=True).clamp_(min=tiny).div_(INT8_MAX)
    scaled = x / step
    high = scaled.round()
    parts = torch.empty((2 * rows, x.shape[1]), dtype=torch.int8)
    parts[:rows].copy_(high)
    parts[rows:].copy_(scaled.sub_(high).mul_(INT8_SPLIT).round_())
    accumulated = torch._int_mm(parts, weight.t())
    out = accumulated[rows:].float().add_(accumulated[:rows], alpha=INT8_SPLIT)
    return out.mul_(step.div_(INT8_SPLIT)).mul_(scale.float())


class Int8Linear(nn.Module):
    """``y = (x @ q.T) * scale + bias``, with the weight stored as int8 and one scale per output.

    Buffers, not parameters: ``module.to(dtype)`` then casts the scales and bias but leaves the
    int8 weight (and its int32 row sums, ``vnni_gemm.weight_sums``) alone.

    On CPU, in either activation dtype: decode batches run ``vnni_gemm``'s int8 kernel (up to
    ``INT8_VNNI_MAX_ROWS`` rows) or, where it is not built, ``torch._weight_int8pack_mm`` in
    bfloat16 (up to ``INT8_KERNEL_MAX_ROWS``), which streams the int8 weight once (its float32
    variant is scalar code: 12x slower than the dense matmul at one row, 345x at 64); larger
    batches run :func:`int8_split_matmul`, whose numbers the VNNI kernel computes. Elsewhere
    (CUDA) the weight is cast per call.
    """

    weight: torch.Tensor
    weight_sums: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: KernelCapabilities,
    ) -> None:
        super().__init__()
        self.use_kernels(kernels)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_sums", vnni_gemm.weight_sums(weight))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self._refresh_kernel_scales()

    def use_kernels(self, kernels: KernelCapabilities) -> None:
        """Whether decodes run the VNNI kernel: a plain attribute, read without tracing a probe."""
        self.vnni = kernels.vnni_gemm

    def _refresh_kernel_scales(self) -> None:
        """The scales in the kernels' dtypes (bfloat16 for torch's, float32 for the VNNI one),
        kept as plain attributes so that ``to()`` leaves them alone and a compiled forward
        reads them as tensors instead of converting per call."""
        self.kernel_scale = self.scale.to(torch.bfloat16)
        self.float_scale = self.scale.float()

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> Int8Linear:
        """After ``to()``, refresh the kernels' scales (``_refresh_kernel_scales``)."""
        super()._apply(fn, recurse)
        self._refresh_kernel_scales()
        return self

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelCapabilities
    ) -> Int8Linear:
        quantized, scale = quantize_rows_int8(weight)
        return cls(quantized, scale, None if bias is None else bias.detach().clone(), kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            rows = x.reshape(-1, x.shape[-1])
            if self.vnni and rows.shape[0] <= INT8_VNNI_MAX_ROWS:
                out = vnni_gemm.int8_op(rows, self.weight, self.weight_sums, self.float_scale)
            elif rows.shape[0] <= INT8_KERNEL_MAX_ROWS:
                bf16 = torch.bfloat16
                out = torch._weight_int8pack_mm(rows.to(bf16), self.weight, self.kernel_scale)
            else:
                out = int8_split_matmul(rows, self.weight, self.scale)
            out = out.reshape(*x.shape[:-1], -1).to(x.dtype)
        else:
            out = nn.functional.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one scale per row (per token)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, token_ids)
        scale = self.scale.index_select(0, token_ids)
        return rows.to(scale.dtype) * scale[:, None]


LAYER_QUANTIZERS: dict[
    str, Callable[[torch.Tensor, torch.Tensor | None, KernelCapabilities], nn.Module]
] = {
    "int8": Int8Linear.from_float,
    "int4": Int4Linear.from_float,
}


def quantize(model: LlamaForCausalLM, quantization: str, kernels: KernelCapabilities) -> None:
    """Quantize the model's weights in place as ``--quantization`` says (``none``: leave them),
    the layers running the engine's ``kernels``.

    Every Linear of the decoder layers becomes an int8 or int4 one. The embeddings and the LM
    head are int8 under both, as llama.cpp's Q4_1 files keep them at 8 bits (Q8_0), and a tied
    head keeps sharing the embedding's int8 table: per-row scales of the embedding are exactly
    per-output-channel scales of the head.
    """
    if quantization == "none":
        return
    layer_quantizer = LAYER_QUANTIZERS[quantization]
    for layer in model.layers:
        for name, child in list(layer.named_children()):
            if isinstance(child, nn.Linear):
                setattr(layer, name, layer_quantizer(child.weight, child.bias, kernels))
    embedding_weight, embedding_scale = quantize_rows_int8(model.embed_tokens.weight)
    model.embed_tokens = Int8Embedding(embedding_weight, embedding_scale)  # type: ignore[assignment]
    if model.shape.tie_word_embeddings:
        lm_head = Int8Linear(embedding_weight, embedding_scale, None, kernels)
    else:
        lm_head = Int8Linear.from_float(model.lm_head, None, kernels)
    del model.lm_head  # a parameter until now; a module cannot take its name while it exists
    model.lm_head = lm_head  # type: ignore[assignment]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each shared tensor counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
