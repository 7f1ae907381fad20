"""The CPU backend: the torch backend, with decodes attended in place by ``cpu_decode.c``.

A decode (one query token) in the torch backend gathers its sequence's blocks into a padded
copy, then attends over the copy: at 16 decodes of 40-700-token contexts that is ~35% of the
step. Here every decode of the step is one call of a small C kernel that reads the blocks where
they lie. Prefills and other multi-token queries keep the torch path.

The kernel is built at first use (``cpu_kernels``). Without a compiler, or where the cache
cannot hold code (a ``noexec`` mount), the backend is unavailable and ``auto`` picks the torch
backend (logged; the start-up line and ``/fingerprint`` name the backend in use).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from llmpool.engine import cpu_kernels
from llmpool.engine.attention import torch_backend
from llmpool.engine.attention.metadata import AttentionMetadata

SOURCE = Path(__file__).with_name("cpu_decode.c")
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# (cache dtype, head_dim) -> the kernel's symbol; None: any head_dim.
KERNELS = {
    (dtype, head_dim): f"paged_decode_{suffix}" + ("" if head_dim is None else f"_{head_dim}")
    for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32"))
    for head_dim in (64, 128, None)
}


SIGNATURE = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]


def build(arch_flags: list[str]) -> ctypes.CDLL | None:
    """The kernel built with ``arch_flags`` (``[]``: the portable build)."""
    return cpu_kernels.build(SOURCE, arch_flags, dict.fromkeys(KERNELS.values(), SIGNATURE))


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernel built for this CPU's instruction sets."""
    return build(cpu_kernels.arch_flags())


def available() -> bool:
    return _library() is not None


@dataclass
class CpuAttentionPlan:
    """The torch plan for multi-token queries, and the step's decodes for the kernel."""

    torch_plan: torch_backend.TorchAttentionPlan
    decode_rows: torch.Tensor  # [d] the decodes' query rows
    decode_block_tables: torch.Tensor  # [d, max_blocks] int64, contiguous
    decode_seq_lens: torch.Tensor  # [d] int64

    @property
    def only_decodes(self) -> bool:
        """Every row is a decode, in order: no gather or scatter needed."""
        return not self.torch_plan.groups


def plan(meta: AttentionMetadata) -> CpuAttentionPlan:
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    is_decode = query_lens == 1
    decodes = torch.nonzero(is_decode).flatten()
    others = torch.nonzero(~is_decode).flatten()
    return CpuAttentionPlan(
        torch_plan=torch_backend.plan_sequences(meta, others),
        decode_rows=meta.query_start_loc[decodes].to(torch.int64),
        decode_block_tables=meta.block_tables[decodes].to(torch.int64).contiguous(),
        decode_seq_lens=meta.seq_lens[decodes].to(torch.int64),
    )


def check_cache_dtype(dtype: torch.dtype) -> None:
    if dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"the cpu attention backend holds bfloat16 or float32 caches, not {dtype};"
            " use attention_backend torch"
        )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attention_plan: CpuAttentionPlan,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """``torch_backend.paged_attention``'s contract, for caches of the query's dtype (bfloat16
    or float32, so unscaled: ``select_backend`` picks this backend only for those)."""
    library = _library()
    if library is None:
        raise RuntimeError("the CPU decode kernel is not built")
    check_cache_dtype(key_cache.dtype)
    if key_cache.dtype != query.dtype or (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError("the cpu attention backend reads caches of the query's dtype, unscaled")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the cpu attention backend reads contiguous caches")  # raw pointers
    if attention_plan.only_decodes:
        decode_query = query.contiguous()
        out = decode_out = torch.empty_like(decode_query)
    else:
        out = torch_backend.paged_attention(
            query, key_cache, value_cache, attention_plan.torch_plan, scale
        )
        decode_query = query.index_select(0, attention_plan.decode_rows)
        decode_out = torch.empty_like(decode_query)
    num_decodes, num_heads, head_dim = decode_query.shape
    if num_decodes:
        name = KERNELS.get((query.dtype, head_dim), KERNELS[query.dtype, None])
        kernel = getattr(library, name)
        kernel(
            decode_query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            attention_plan.decode_block_tables.data_ptr(),
            attention_plan.decode_seq_lens.data_ptr(),
            decode_out.data_ptr(),
            num_decodes,
            num_heads,
            key_cache.shape[2],
            head_dim,
            key_cache.shape[1],
            attention_plan.decode_block_tables.shape[1],
            scale,
        )
    if not attention_plan.only_decodes:
        out.index_copy_(0, attention_plan.decode_rows, decode_out)
    return out
