"""Multi-token queries (prompts, prefill chunks) attended where their blocks lie, on CPU:
``cpu_prefill.c``, and the call of it.

The CPU attention backend (``attention/cpu_backend.py``) sends a step's queries of more than
one token here when this CPU has a build (AVX2 or AVX-512) for the cache's dtype and head_dim;
other shapes keep the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from llmpool.engine.kernels import c_loader
from llmpool.engine.kernels.c_loader import CKernel

# (cache dtype, head_dim) -> the kernel's symbol.
SYMBOLS = {
    (dtype, head_dim): f"paged_prefill_{suffix}_{head_dim}"
    for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32"))
    for head_dim in (64, 128)
}
SIGNATURE = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 5 + [ctypes.c_float]
# This CPU's widest vector build; bfloat16 caches with vdpbf16ps where it has AVX-512 BF16.
KERNEL = CKernel(
    "cpu_prefill.c",
    dict.fromkeys(SYMBOLS.values(), SIGNATURE),
    lambda: c_loader.with_avx512_bf16(c_loader.avx2_or_wider()),
)


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel has a build for a cache of ``dtype`` with ``head_dim``."""
    return (dtype, head_dim) in SYMBOLS


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    library: ctypes.CDLL | None = None,
) -> None:
    """Causal attention of the query rows ``query_starts[s] .. + query_lens[s]`` of each sequence
    ``s`` (the last ``query_lens[s]`` of its ``seq_lens[s]`` positions) over contiguous caches
    ``[blocks, block_size, kv_heads, head_dim]`` through ``block_tables`` ``[seqs, max_blocks]``,
    written to the same rows of ``out``. ``query`` and ``out`` are contiguous
    ``[tokens, heads, head_dim]`` of the caches' dtype; the index tensors int64, contiguous.
    ``library``: another build of the kernel (a benchmark's AVX2 one); default this CPU's."""
    num_seqs = query_lens.shape[0]
    if not num_seqs:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    getattr(library or KERNEL.built(), SYMBOLS[query.dtype, head_dim])(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        query_starts.data_ptr(),
        query_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        key_cache.shape[2],
        key_cache.shape[1],
        block_tables.shape[1],
        scale,
    )
