"""The torch and cpu paged-attention backends against dense causal attention, one sequence at a
time (the cpu backend's decodes run ``cpu_decode.c``, its other queries ``cpu_prefill.c`` for
head_dim 64 and 128 where it is built, the torch path otherwise)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmpool.engine.attention import (
    TORCH,
    Backend,
    check_kv_cache_dtype,
    cpu_backend,
    select_backend,
)
from llmpool.engine.attention.torch_backend import plan
from llmpool.engine.kernels import (
    c_loader,
    cpu_decode,
    cpu_decoder,
    cpu_layer_ops,
    cpu_lora,
    cpu_prefill,
)
from llmpool.engine.kernels.capabilities import KernelCapabilities, probe_kernels
from llmpool.engine.kv_cache import FP8_DTYPE, LayerKVCache
from tests.paged_batches import scattered_batch

KERNELS = probe_kernels(torch.device("cpu"))
CPU = select_backend(torch.device("cpu"), "cpu", kernels=KERNELS)

NUM_KV_HEADS = 2
HEAD_DIM = 16
BACKENDS = pytest.mark.parametrize("backend", [TORCH, CPU], ids=["torch", "cpu"])


def _dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``len(query)`` positions over contiguous K/V, GQA repeated."""
    queries_per_kv = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(queries_per_kv, dim=1)
    value = value.repeat_interleave(queries_per_kv, dim=1)
    seq_len, query_len = key.shape[0], query.shape[0]
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    query_pos = torch.arange(seq_len - query_len, seq_len)
    scores.masked_fill_(torch.arange(seq_len)[None, None, :] > query_pos[None, :, None], -torch.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), value)


def _check(
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    queries_per_kv: int,
    backend: Backend,
    dtype: torch.dtype = torch.float32,
    head_dim: int = HEAD_DIM,
) -> None:
    batch = scattered_batch(seq_lens, query_lens, block_size, seed=len(seq_lens))
    generator = torch.Generator().manual_seed(sum(seq_lens))
    total = sum(seq_lens)
    keys = torch.randn(total, NUM_KV_HEADS, head_dim, generator=generator).to(dtype)
    values = torch.randn(total, NUM_KV_HEADS, head_dim, generator=generator).to(dtype)
    num_heads = NUM_KV_HEADS * queries_per_kv
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    key_cache = torch.zeros(batch.num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype=dtype)
    cache = LayerKVCache(key_cache, torch.zeros_like(key_cache))
    backend.write_kv(keys, values, cache, torch.tensor(batch.all_slots))
    scale = head_dim**-0.5
    # bfloat16 outputs are rounded once: within a step of bfloat16's 8-bit mantissa.
    atol, rtol = (2e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)

    actual = backend.paged_attention(query, cache, backend.plan(batch.meta), scale)

    token_start = query_start = 0
    for seq_len, query_len in zip(seq_lens, query_lens, strict=True):
        expected = _dense_attention(
            query[query_start : query_start + query_len].float(),
            keys[token_start : token_start + seq_len].float(),
            values[token_start : token_start + seq_len].float(),
            scale,
        )
        torch.testing.assert_close(
            actual[query_start : query_start + query_len].float(), expected, atol=atol, rtol=rtol
        )
        token_start += seq_len
        query_start += query_len


@BACKENDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_of_far_apart_lengths_and_prefill_chunks(
    backend: Backend, dtype: torch.dtype
) -> None:
    # Decodes of 3 to 700 tokens (cut into several context groups), a whole prompt, and a
    # prefill chunk after cached context.
    seq_lens = [700, 3, 130, 17, 690, 300, 64, 260]
    query_lens = [1, 1, 1, 1, 1, 1, 64, 200]
    for block_size in (1, 16):
        _check(seq_lens, query_lens, block_size, 3, backend, dtype)


@BACKENDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("queries_per_kv", [1, 2, 3, 4, 8])
def test_a_step_of_decodes_only(
    backend: Backend, dtype: torch.dtype, head_dim: int, queries_per_kv: int
) -> None:
    """head_dim 64 and 128 run the cpu backend's vector kernels where the CPU has AVX2 or AVX-512:
    up to 4 query heads per KV head with their sums held in registers, more in memory; 5
    sequences as work items of one KV head, 10 (4 a thread or more) of a whole sequence."""
    few = [513, 1, 40, 1024, 77]
    for seq_lens in (few, [*few, 700, 16, 17, 250, 3]):
        _check(seq_lens, [1] * len(seq_lens), 16, queries_per_kv, backend, dtype, head_dim)


@pytest.mark.skipif(not KERNELS.cpu_prefill, reason="cpu_prefill.c needs AVX2 or AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
def test_prompts_and_prefill_chunks_run_the_prefill_kernel(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int, queries_per_kv: int
) -> None:
    """Query tiles (16 positions) and key tiles (64 or 32 keys) cut anywhere: whole prompts, a
    chunk after 255 cached tokens, 2-token tails, beside decodes; the torch path is not taken."""

    def torch_path(*args: object) -> torch.Tensor:
        raise AssertionError("the torch path attended a query the prefill kernel takes")

    monkeypatch.setattr(cpu_backend.torch_backend, "paged_attention", torch_path)
    seq_lens = [700, 45, 17, 300, 64, 65, 2, 129]
    query_lens = [700, 45, 17, 45, 64, 1, 2, 33]
    for block_size in (1, 16):
        _check(seq_lens, query_lens, block_size, queries_per_kv, CPU, dtype, head_dim)


@pytest.mark.skipif(
    c_loader.arch_flags() != c_loader.AVX512_BUILD, reason="the other builds run on AVX-512 CPUs"
)
@pytest.mark.parametrize("build", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_other_builds_of_the_attention_kernels_match_too(
    monkeypatch: pytest.MonkeyPatch, build: str, dtype: torch.dtype, head_dim: int
) -> None:
    """The builds of the prefill and decode kernels that an AVX2 CPU runs (8 lanes, 32-key
    tiles, fewer rows a pass) and an AVX-512 CPU without AVX-512 BF16 or AMX runs (bfloat16 by
    float32 FMAs, not vdpbf16ps or AMX tiles), here."""
    flags = {"avx2": c_loader.AVX2_BUILD, "avx512": c_loader.AVX512_BUILD}[build]
    for kernel in (cpu_prefill.KERNEL, cpu_decode.KERNEL):
        library = kernel.build(flags)
        assert library is not None
        monkeypatch.setattr(kernel, "library", lambda library=library: library)
    _check([700, 45, 129, 3, 513, 40], [700, 45, 33, 1, 1, 1], 16, 3, CPU, dtype, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_portable_kernel_matches_too(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int
) -> None:
    """The kernel built without instruction-set flags (what a CPU without AVX2 runs)."""
    portable = cpu_decode.KERNEL.build([])
    assert portable is not None
    monkeypatch.setattr(cpu_decode.KERNEL, "library", lambda: portable)
    seq_lens = [300, 5, 1000]
    _check(seq_lens, [1, 1, 1], 16, 3, CPU, dtype, head_dim)
    _check([300, 200, 64], [1, 1, 64], 16, 3, CPU, dtype, head_dim)  # decodes beside a prefill


def test_auto_picks_the_cpu_backend_for_its_cache_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert select_backend(cpu, "auto", torch.bfloat16, kernels=KERNELS).name == "cpu"
    assert select_backend(cpu, "auto", torch.float32, kernels=KERNELS).name == "cpu"
    assert select_backend(cpu, "auto", FP8_DTYPE, kernels=KERNELS).name == "torch"
    assert select_backend(cpu, "torch", torch.float32, kernels=KERNELS).name == "torch"
    with pytest.raises(ValueError, match="bfloat16 or float32 caches"):
        check_kv_cache_dtype(CPU, FP8_DTYPE, cpu)
    monkeypatch.setattr(c_loader, "_compiler", lambda: None)
    without_compiler = probed_anew(monkeypatch)
    assert not without_compiler.cpu_decode and not without_compiler.cpu_layer_ops
    assert not without_compiler.cpu_prefill
    assert not without_compiler.cpu_decoder
    assert select_backend(cpu, "auto", torch.float32, kernels=without_compiler).name == "torch"
    with pytest.raises(ValueError, match="C compiler"):
        select_backend(cpu, "cpu", kernels=without_compiler)


def probed_anew(monkeypatch: pytest.MonkeyPatch) -> KernelCapabilities:
    """The capabilities probed again with the C kernels rebuilt (each kept as it was after)."""
    for kernel in (
        cpu_decode.KERNEL,
        cpu_prefill.KERNEL,
        cpu_lora.KERNEL,
        cpu_layer_ops.KERNEL,
        cpu_decoder.KERNEL,
    ):
        monkeypatch.setattr(kernel, "_library", None)
        monkeypatch.setattr(kernel, "_tried", False)
    return probe_kernels(torch.device("cpu"))


def test_plan_cuts_context_groups_and_keeps_every_query_once() -> None:
    seq_lens = [700, 20, 690, 170, 40]
    batch = scattered_batch(seq_lens, [1] * len(seq_lens), block_size=16, seed=0)
    groups = plan(batch.meta).groups
    widths = sorted(group.block_tables.shape[1] for group in groups)
    # 20 and 40 tokens share a group (2 and 3 blocks); 170 is alone (11); 690 and 700 (44).
    assert widths == [3, 11, 44]
    rows = torch.cat([group.valid_rows for group in groups]).sort().values
    assert rows.tolist() == list(range(len(seq_lens)))


@BACKENDS
@settings(max_examples=40, deadline=None)
@given(
    sequences=st.lists(
        st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
        min_size=1,
        max_size=8,
    ),
    block_size=st.sampled_from([1, 4, 16]),
    queries_per_kv=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([HEAD_DIM, 64]),
)
def test_matches_dense_attention(
    backend: Backend,
    sequences: list[tuple[int, int]],
    block_size: int,
    queries_per_kv: int,
    head_dim: int,
) -> None:
    """head_dim 64 runs the cpu backend's C kernels, 16 its decode kernel and the torch path."""
    seq_lens = [seq_len for seq_len, _ in sequences]
    query_lens = [query_len for _, query_len in sequences]
    _check(seq_lens, query_lens, block_size, queries_per_kv, backend, head_dim=head_dim)


def test_a_kernel_that_cannot_be_loaded_leaves_the_torch_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A cache directory on a noexec mount: the build succeeds, loading fails, auto picks torch."""
    monkeypatch.setenv("LLMPOOL_KERNEL_CACHE", str(tmp_path))

    def refuse(path: str) -> None:
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(c_loader, "DeclaredLibrary", refuse)
    assert cpu_decode.KERNEL.build([]) is None
    kernels = probed_anew(monkeypatch)
    assert (
        select_backend(torch.device("cpu"), "auto", torch.float32, kernels=kernels).name == "torch"
    )
