"""A layer's RMSNorms, rotary embedding and SiLU-and-mul on CPU: ``cpu_layer_ops.c``, and the
calls of it.

Each function has the signature and the results of its torch reference in ``engine/ops.py``
(the CPU attention backend runs these in its place). The reference costs 7 small ops a norm and
~20 a rotary, ~19 and ~40 us at one decoding row on a 2-core Zen 4 EPYC, most of it per-op
overhead: ~3 ms of a 17 ms eager bfloat16 decode step of SmolLM2 at one request (the kernel: 6 and
12 us, the step 1.18x as fast; ``benchmarks/layer_ops.py``). SiLU-and-mul's three ops are cheap at
a decoding row but three passes over a prefill step's ``[2048, 2 * 1536]`` activations (~4% of
that step); the kernel's one pass is 1.6x faster there. The kernel takes what it can
(contiguous CPU rows of bfloat16 or float32, one dtype throughout) and hands anything else, and
every call inside a compiled region (where inductor fuses the reference), to the reference.
"""

from __future__ import annotations

import ctypes

import torch

from llmpool.engine import ops
from llmpool.engine.kernels.c_loader import CKernel

SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
# dtype -> the kernel's symbol of each op.
NORM_SYMBOLS = {dtype: f"add_rms_norm_{suffix}" for dtype, suffix in SUFFIXES.items()}
ROTARY_SYMBOLS = {dtype: f"rotary_{suffix}" for dtype, suffix in SUFFIXES.items()}
SILU_SYMBOLS = {dtype: f"silu_and_mul_{suffix}" for dtype, suffix in SUFFIXES.items()}
MAX_HEAD_DIM = 512  # the kernel's per-token cos/sin buffers (MAX_HALF)

_pointers, _sizes = [ctypes.c_void_p], [ctypes.c_int64]
KERNEL = CKernel(
    "cpu_layer_ops.c",
    {
        **dict.fromkeys(NORM_SYMBOLS.values(), _pointers * 5 + _sizes * 2 + [ctypes.c_float]),
        **dict.fromkeys(ROTARY_SYMBOLS.values(), _pointers * 6 + _sizes * 6),
        **dict.fromkeys(SILU_SYMBOLS.values(), _pointers * 2 + _sizes * 2),
    },
)


def _runs_here(*tensors: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: CPU tensors of one kernel dtype, outside a
    compiled region."""
    dtype = tensors[0].dtype
    if dtype not in SUFFIXES or torch.compiler.is_compiling():
        return False
    return all(t.dtype == dtype and t.is_cpu for t in tensors)


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # Every operand is held by a name for the whole call: ctypes gets bare addresses.
    hidden = x.shape[-1]
    x, weight = x.contiguous(), weight.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = torch.empty_like(x)
    new_residual = None if residual is None else torch.empty_like(x)
    rows = x.numel() // hidden if hidden else 0
    if rows:
        getattr(KERNEL.built(), NORM_SYMBOLS[x.dtype])(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            None if new_residual is None else new_residual.data_ptr(),
            rows,
            hidden,
            eps,
        )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.rms_norm``."""
    if not _runs_here(x, weight):
        return ops.rms_norm(x, weight, eps)
    return _norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.fused_add_rms_norm``."""
    if not _runs_here(x, residual, weight) or x.shape != residual.shape:
        return ops.fused_add_rms_norm(x, residual, weight, eps)
    out, new_residual = _norm(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.rotary_embedding``; the results are contiguous. ``positions`` must lie within
    ``cos_sin_cache`` (the engine's are below ``max_model_len``, which the cache covers)."""
    tokens, heads, head_dim = query.shape
    if (
        not _runs_here(query, key)
        or cos_sin_cache.dtype != torch.float32
        or head_dim > MAX_HEAD_DIM
        or head_dim % 2
        or query.stride()[1:] != (head_dim, 1)
        or key.stride()[1:] != (head_dim, 1)
    ):
        return ops.rotary_embedding(positions, query, key, cos_sin_cache)
    positions = positions.to(torch.int64).contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    query_out = torch.empty(query.shape, dtype=query.dtype)
    key_out = torch.empty(key.shape, dtype=key.dtype)
    if tokens:
        getattr(KERNEL.built(), ROTARY_SYMBOLS[query.dtype])(
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            query.data_ptr(),
            key.data_ptr(),
            query_out.data_ptr(),
            key_out.data_ptr(),
            tokens,
            heads,
            key.shape[1],
            head_dim,
            query.stride(0),
            key.stride(0),
        )
    return query_out, key_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``ops.silu_and_mul``."""
    width = gate_up.shape[-1] // 2
    if not _runs_here(gate_up) or gate_up.shape[-1] % 2:
        return ops.silu_and_mul(gate_up)
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype)
    rows = out.numel() // width if width else 0
    if rows:
        getattr(KERNEL.built(), SILU_SYMBOLS[gate_up.dtype])(
            gate_up.data_ptr(), out.data_ptr(), rows, width
        )
    return out
