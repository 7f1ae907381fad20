"""``cpu_layer_ops.c`` (the CPU backend's norms, rotary and SiLU-and-mul) against the torch
reference, ``engine/ops.py``: rotary and SiLU-and-mul bit for bit, the norms bit for bit but where
the variance's summation order moves a last bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmpool.engine import ops
from llmpool.engine.attention import cpu_backend_with
from llmpool.engine.kernels import cpu_layer_ops
from llmpool.engine.kernels.capabilities import KernelCapabilities, probe_kernels

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# One unit in the last place of the kernel dtypes, relative.
ULP = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}


def norm_operands(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x, residual = (3 * torch.randn(2, rows, hidden, generator=generator)).to(dtype)
    weight = torch.randn(hidden, generator=generator).to(dtype)
    return [x, residual, weight]


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for the last bits: a variance one unit off moves the whole row's results by a
    unit or two in the last place (in float32 most of them; in bfloat16 few survive rounding)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    ulp = ULP[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=4 * ulp, atol=0.0)


@DTYPES
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), hidden=st.sampled_from([1, 15, 16, 17, 64, 576, 1000]))
def test_norms_match_the_reference(dtype: torch.dtype, rows: int, hidden: int) -> None:
    """Row counts on both sides of the threaded split (32), widths around the 16 partial sums."""
    x, residual, weight = norm_operands(rows, hidden, dtype, seed=rows * hidden)
    out, new_residual = cpu_layer_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)  # one rounded add: exact
    assert_within_one_ulp(out, expected_out)
    assert_within_one_ulp(cpu_layer_ops.rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5))


def test_the_norm_reads_rows_of_any_leading_shape_and_layout() -> None:
    x, residual, weight = norm_operands(12, 64, torch.bfloat16, seed=1)
    x3 = x.view(3, 4, 64).transpose(0, 1)  # not contiguous
    out, new_residual = cpu_layer_ops.fused_add_rms_norm(
        x3, residual.view(3, 4, 64).transpose(0, 1), weight, 1e-6
    )
    expected_out, expected_residual = ops.fused_add_rms_norm(
        x3, residual.view(3, 4, 64).transpose(0, 1), weight, 1e-6
    )
    assert out.shape == (4, 3, 64)
    assert torch.equal(new_residual, expected_residual)
    assert_within_one_ulp(out, expected_out)
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    assert cpu_layer_ops.rms_norm(empty, weight, 1e-6).shape == (0, 64)


def fused_qkv(
    tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key as the layer gives them: views into one fused QKV row per token."""
    generator = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=generator).to(dtype)
    query, key, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return (
        query.view(tokens, heads, head_dim),
        key.view(tokens, kv_heads, head_dim),
    )


@DTYPES
@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(0, 70),
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1)]),
    head_dim=st.sampled_from([2, 64, 128, 512]),
    positions_dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_rotary_matches_the_reference_bit_for_bit(
    dtype: torch.dtype,
    tokens: int,
    heads: tuple[int, int],
    head_dim: int,
    positions_dtype: torch.dtype,
) -> None:
    query, key = fused_qkv(tokens, *heads, head_dim, dtype, seed=tokens)
    cos_sin = torch.randn(4096, head_dim)
    positions = torch.randint(0, 4096, (tokens,), dtype=positions_dtype)
    rotated = cpu_layer_ops.rotary_embedding(positions, query, key, cos_sin)
    expected = ops.rotary_embedding(positions, query, key, cos_sin)
    for actual, reference in zip(rotated, expected, strict=True):
        assert actual.is_contiguous()
        assert torch.equal(actual, reference)


def gate_up_operand(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gate and up halves over SiLU's whole range: exp(-g) under- and overflowing at the ends."""
    generator = torch.Generator().manual_seed(seed)
    gate_up = 6 * torch.randn(rows, 2 * width, generator=generator)
    gate_up[0, : min(width, 6)] = torch.tensor([-120.0, -88.0, -20.0, 0.0, 88.0, 120.0])[:width]
    return gate_up.to(dtype)


@DTYPES
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (3, 17), (40, 64), (2048, 1536)])
def test_silu_and_mul_matches_the_reference_bit_for_bit(
    dtype: torch.dtype, rows: int, width: int
) -> None:
    """One decoding row, an odd width, and a 2,048-token prefill step's (rows split over threads).
    torch computes a row's last width % 16 elements with scalar ``exp`` (not SLEEF's vector one),
    so there, and for a transposed layout, it is a unit in the last place off itself."""
    for seed in range(3):
        gate_up = gate_up_operand(rows, width, dtype, seed)
        actual, expected = cpu_layer_ops.silu_and_mul(gate_up), ops.silu_and_mul(gate_up)
        if width % 16:
            assert_within_one_ulp(actual, expected)
        else:
            assert torch.equal(actual, expected)
    strided = gate_up.t().contiguous().t()
    assert_within_one_ulp(cpu_layer_ops.silu_and_mul(strided), ops.silu_and_mul(strided))


def test_what_the_kernel_does_not_take_goes_to_the_reference() -> None:
    """float16, mixed dtypes, a head_dim over the kernel's buffers, a float64 cos/sin cache."""
    x, residual, weight = norm_operands(3, 64, torch.float16, seed=2)
    assert torch.equal(
        cpu_layer_ops.fused_add_rms_norm(x, residual, weight, 1e-5)[0],
        ops.fused_add_rms_norm(x, residual, weight, 1e-5)[0],
    )
    x, residual, _ = norm_operands(3, 64, torch.bfloat16, seed=2)
    weight = torch.randn(64)
    assert torch.equal(cpu_layer_ops.rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5))
    assert cpu_layer_ops.rms_norm(x, weight, 1e-5).dtype == torch.float32  # promoted, as torch
    for head_dim, cache_dtype in ((1024, torch.float32), (64, torch.float64)):
        query, key = fused_qkv(5, 2, 1, head_dim, torch.bfloat16, seed=3)
        cos_sin = torch.randn(16, head_dim, dtype=cache_dtype)
        positions = torch.arange(5)
        rotated = cpu_layer_ops.rotary_embedding(positions, query, key, cos_sin)
        expected = ops.rotary_embedding(positions, query, key, cos_sin)
        assert all(map(torch.equal, rotated, expected))
    half = torch.randn(3, 64, dtype=torch.float16)
    assert torch.equal(cpu_layer_ops.silu_and_mul(half), ops.silu_and_mul(half))


@DTYPES
def test_the_portable_build_matches_too(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Built without instruction-set flags (what a CPU without AVX2 runs)."""
    portable = cpu_layer_ops.KERNEL.build([])
    assert portable is not None
    monkeypatch.setattr(cpu_layer_ops.KERNEL, "library", lambda: portable)
    x, residual, weight = norm_operands(40, 576, dtype, seed=4)
    out, new_residual = cpu_layer_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)
    assert_within_one_ulp(out, expected_out)
    query, key = fused_qkv(40, 9, 3, 64, dtype, seed=4)
    cos_sin, positions = torch.randn(100, 64), torch.randint(0, 100, (40,))
    rotated = cpu_layer_ops.rotary_embedding(positions, query, key, cos_sin)
    assert all(map(torch.equal, rotated, ops.rotary_embedding(positions, query, key, cos_sin)))
    gate_up = gate_up_operand(40, 1536, dtype, seed=4)
    assert torch.equal(cpu_layer_ops.silu_and_mul(gate_up), ops.silu_and_mul(gate_up))


def test_the_cpu_backend_runs_them_where_they_are_built() -> None:
    assert probe_kernels(torch.device("cpu")).cpu_layer_ops
    built = cpu_backend_with(KernelCapabilities(cpu_decode=True, cpu_layer_ops=True))
    assert built.fused_add_rms_norm is cpu_layer_ops.fused_add_rms_norm
    assert built.rms_norm is cpu_layer_ops.rms_norm
    assert built.rotary_embedding is cpu_layer_ops.rotary_embedding
    assert built.silu_and_mul is cpu_layer_ops.silu_and_mul
    without = cpu_backend_with(KernelCapabilities(cpu_decode=True))
    assert without.fused_add_rms_norm is ops.fused_add_rms_norm
    assert without.rotary_embedding is ops.rotary_embedding
    assert without.silu_and_mul is ops.silu_and_mul
