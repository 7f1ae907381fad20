"""The CPU backend: the torch backend, with attention read from the paged cache in place by C
kernels: decodes by ``cpu_decode.c``, multi-token queries by ``cpu_prefill.c``.

A decode (one query token) in the torch backend gathers its sequence's blocks into a padded
copy, then attends over the copy: at 16 decodes of 40-700-token contexts that is ~35% of the
step. Here every decode of the step is one call of a small C kernel that reads the blocks where
they lie. Prompts and prefill chunks likewise go to one call of ``cpu_prefill.c`` (tiled, with
an online softmax): torch's flash attention behind a padded copy and a boolean mask attended a
2,048-token prefill step at a third (float32) to a fifth (bfloat16) of that kernel's speed
(``benchmarks/prefill_attention.py``). Where the prefill kernel has no
build (a CPU without AVX2, a head_dim other than 64 or 128), those queries keep the torch path.

The kernels are built when the engine probes its kernels (``kernels.capabilities``). Without a
compiler, or where the cache cannot hold code (a ``noexec`` mount), the backend is unavailable
and ``auto`` picks the torch backend (logged; the start-up line and ``/fingerprint`` name the
backend in use).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import torch

from llmpool.engine.attention import torch_backend
from llmpool.engine.attention.metadata import AttentionMetadata
from llmpool.engine.kernels import cpu_decode, cpu_prefill
from llmpool.engine.kv_cache import LayerKVCache


@dataclass
class CpuAttentionPlan:
    """The step's decodes for ``cpu_decode.c`` and its other sequences for ``cpu_prefill.c``,
    or, where that kernel has no build for a layer's shape, for the torch path."""

    meta: AttentionMetadata
    others: torch.Tensor  # [p] the sequences with more than one query token
    decode_rows: torch.Tensor  # [d] the decodes' query rows
    decode_block_tables: torch.Tensor  # [d, max_blocks] int64, contiguous
    decode_seq_lens: torch.Tensor  # [d] int64
    prefill_kernel: bool  # cpu_prefill.c is built here

    @property
    def only_decodes(self) -> bool:
        """Every row is a decode, in order: no gather or scatter needed."""
        return not self.others.numel()

    @cached_property
    def torch_plan(self) -> torch_backend.TorchAttentionPlan:
        """The torch path's plan of the other sequences, made the first time a layer needs it."""
        return torch_backend.plan_sequences(self.meta, self.others)

    @cached_property
    def prefills(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``cpu_prefill.paged_prefill``'s block tables, seq_lens, query starts and lengths."""
        meta, others = self.meta, self.others
        starts = meta.query_start_loc[others].to(torch.int64)
        return (
            meta.block_tables[others].to(torch.int64).contiguous(),
            meta.seq_lens[others].to(torch.int64),
            starts,
            meta.query_start_loc[others + 1].to(torch.int64) - starts,
        )


def plan(meta: AttentionMetadata, prefill_kernel: bool = False) -> CpuAttentionPlan:
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    is_decode = query_lens == 1
    decodes = torch.nonzero(is_decode).flatten()
    return CpuAttentionPlan(
        meta=meta,
        others=torch.nonzero(~is_decode).flatten(),
        decode_rows=meta.query_start_loc[decodes].to(torch.int64),
        decode_block_tables=meta.block_tables[decodes].to(torch.int64).contiguous(),
        decode_seq_lens=meta.seq_lens[decodes].to(torch.int64),
        prefill_kernel=prefill_kernel,
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
    if attention_plan.prefill_kernel and cpu_prefill.supports(query.dtype, query.shape[2]):
        query = query.contiguous()
        out = torch.empty_like(query)
        cpu_prefill.paged_prefill(
            query, cache.key, cache.value, *attention_plan.prefills, out=out, scale=scale
        )
    else:
        out = torch_backend.paged_attention(query, cache, attention_plan.torch_plan, scale)
    if not attention_plan.decode_rows.numel():
        return out
    decode_out = decode(query.index_select(0, attention_plan.decode_rows))
    return out.index_copy_(0, attention_plan.decode_rows, decode_out)
