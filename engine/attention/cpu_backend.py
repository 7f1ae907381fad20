"""The CPU backend: the torch backend, with decodes attended in place by ``cpu_decode.c``.

A decode (one query token) in the torch backend gathers its sequence's blocks into a padded
copy, then attends over the copy: at 16 decodes of 40-700-token contexts that is ~35% of the
step. Here every decode of the step is one call of a small C kernel that reads the blocks where
they lie. Prefills and other multi-token queries keep the torch path.

The kernel (``kernels/cpu_decode.py``) is built when the engine probes its kernels
(``kernels.capabilities``). Without a compiler, or where the cache cannot hold code (a
``noexec`` mount), the backend is unavailable and ``auto`` picks the torch backend (logged; the
start-up line and ``/fingerprint`` name the backend in use).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from llmpool.engine.attention import torch_backend
from llmpool.engine.attention.metadata import AttentionMetadata
from llmpool.engine.kernels import cpu_decode
from llmpool.engine.kv_cache import LayerKVCache


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
    if dtype not in cpu_decode.KERNEL_DTYPES:
        raise ValueError(
            f"the cpu attention backend holds bfloat16 or float32 caches, not {dtype};"
            " use attention_backend torch"
        )


def paged_attention(
    query: torch.Tensor, cache: LayerKVCache, attention_plan: CpuAttentionPlan, scale: float
) -> torch.Tensor:
    """``torch_backend.paged_attention``'s contract, for caches of the query's dtype (bfloat16
    or float32, so unscaled: ``select_backend`` picks this backend only for those)."""
    check_cache_dtype(cache.key.dtype)
    if cache.key.dtype != query.dtype or (cache.k_scale, cache.v_scale) != (1.0, 1.0):
        raise ValueError("the cpu attention backend reads caches of the query's dtype, unscaled")
    if not (cache.key.is_contiguous() and cache.value.is_contiguous()):
        raise ValueError("the cpu attention backend reads contiguous caches")  # raw pointers
    decode = functools.partial(
        cpu_decode.paged_decode,
        key_cache=cache.key,
        value_cache=cache.value,
        block_tables=attention_plan.decode_block_tables,
        seq_lens=attention_plan.decode_seq_lens,
        scale=scale,
    )
    if attention_plan.only_decodes:
        return decode(query.contiguous())
    out = torch_backend.paged_attention(query, cache, attention_plan.torch_plan, scale)
    decode_out = decode(query.index_select(0, attention_plan.decode_rows))
    return out.index_copy_(0, attention_plan.decode_rows, decode_out)
