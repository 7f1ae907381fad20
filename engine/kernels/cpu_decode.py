"""Decodes attended where their blocks lie, on CPU: ``cpu_decode.c``, and the call of it.

One call attends every decode (one query token) of a step over its sequence's paged K/V, reading
the blocks in place instead of gathering them into a padded copy (the CPU attention backend,
``attention/cpu_backend.py``, sends its decodes here).
"""

from __future__ import annotations

import ctypes

import torch

from llmpool.engine.kernels.c_loader import CKernel, arch_flags, with_amx, with_avx512_bf16

KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# (cache dtype, head_dim) -> the kernel's symbol; None: any head_dim.
SYMBOLS = {
    (dtype, head_dim): f"paged_decode_{suffix}" + ("" if head_dim is None else f"_{head_dim}")
    for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32"))
    for head_dim in (64, 128, None)
}
SIGNATURE = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]
# Built for this CPU's widest vector instructions (portable code elsewhere), with AMX's tiles for
# the bfloat16 scores where the CPU has them.
KERNEL = CKernel(
    "cpu_decode.c",
    dict.fromkeys(SYMBOLS.values(), SIGNATURE),
    lambda: with_amx(with_avx512_bf16(arch_flags())),
)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[decodes, heads, head_dim]`` (contiguous, the caches' dtype),
    one token per sequence, over contiguous caches ``[blocks, block_size, kv_heads, head_dim]``
    through int64 ``block_tables`` ``[decodes, max_blocks]`` and ``seq_lens`` ``[decodes]``.
    ``library``: another build of the kernel (a benchmark's portable one); default this CPU's."""
    out = torch.empty_like(query)
    num_decodes, num_heads, head_dim = query.shape
    if num_decodes:
        name = SYMBOLS.get((query.dtype, head_dim), SYMBOLS[query.dtype, None])
        getattr(library or KERNEL.built(), name)(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            num_decodes,
            num_heads,
            key_cache.shape[2],
            head_dim,
            key_cache.shape[1],
            block_tables.shape[1],
            scale,
        )
    return out
