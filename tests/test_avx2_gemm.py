"""The AVX2 few-row GEMMs (``kernels/avx2_gemm.c``): each equals the float32 product of its
operands up to summation order, at every tile shape, and ``models.linear`` runs them where the
engine's choice says."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmpool.engine.kernels import avx2_gemm
from llmpool.engine.models import linear
from llmpool.engine.models.linear import GemmChoice
from tests.conftest import needs_avx2
from tests.test_linear import IN, OUT, assert_no_less_exact, operands

pytestmark = needs_avx2()

# Every tile shape: 1 row and 4-row tiles with remainders, outputs past a multiple of 4, inputs
# of whole 16-element chunks, a partial last chunk, and a partial chunk alone.
ROWS = [1, 2, 3, 4, 5, 16, 17, 64]
SHAPES = [(576, 320), (1536, 7), (100, 4), (31, 5), (7, 1)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("inputs", "outputs"), SHAPES)
def test_float32_is_the_float32_product(rows: int, inputs: int, outputs: int) -> None:
    x, weight, _ = operands(rows, torch.float32, inputs, outputs)
    out = avx2_gemm.f32_linear(x, weight)
    assert out.dtype == torch.float32 and out.shape == (rows, outputs)
    exact = nn.functional.linear(x.double(), weight.double())
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * inputs**0.5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("inputs", "outputs"), SHAPES)
def test_bfloat16_is_the_float32_product_rounded_once(rows: int, inputs: int, outputs: int) -> None:
    x, weight, _ = operands(rows, torch.bfloat16, inputs, outputs)
    out = avx2_gemm.bf16_linear(x, weight)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, outputs)
    product = nn.functional.linear(x.float(), weight.float())
    # float32 sums differing only in order, each rounded once to bfloat16 (2^-8 relative)
    torch.testing.assert_close(out.float(), product, rtol=2**-8, atol=1e-6)
    assert_no_less_exact(out, x, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_empty_batches_nan_and_wrong_operands(dtype: torch.dtype) -> None:
    run = avx2_gemm.f32_linear if dtype == torch.float32 else avx2_gemm.bf16_linear
    x, weight, _ = operands(8, dtype)
    strided = torch.cat([x, x], dim=1)[:, :IN]
    assert torch.equal(run(strided, weight), run(x, weight))
    assert run(x[:0], weight).shape == (0, OUT)
    x[3, 5] = float("nan")
    out = run(x, weight)
    assert out[3].isnan().all() and not out[[0, 1, 2, 4]].isnan().any()
    other = torch.float16
    with pytest.raises(ValueError, match="multiplies"):
        run(x.to(other), weight.to(other))
    with pytest.raises(ValueError, match="shapes"):
        run(x[:, :-1], weight)


def test_linear_runs_the_float32_kernel_up_to_its_rows_then_torch() -> None:
    gemm = GemmChoice(float32_kernel_max_rows=16)
    for rows in (1, 16):
        x, weight, bias = operands(rows, torch.float32)
        expected = avx2_gemm.f32_linear(x, weight) + bias
        assert torch.equal(linear.linear(x, weight, bias, gemm), expected)
    x, weight, bias = operands(17, torch.float32)
    assert torch.equal(linear.linear(x, weight, bias, gemm), linear.linear(x, weight, bias))


def test_linear_runs_the_named_bfloat16_kernel() -> None:
    gemm = GemmChoice(bfloat16_kernel_max_rows=128, bfloat16_kernel="avx2_gemm")
    x, weight, bias = operands(16, torch.bfloat16)
    expected = avx2_gemm.bf16_linear(x, weight) + bias
    assert torch.equal(linear.linear(x, weight, bias, gemm), expected)


def test_the_float32_probe_measures_a_positive_ratio() -> None:
    _, weight, _ = operands(1, torch.float32)
    assert 0 < linear.probe_float32_kernel(weight, rows=4, repeats=3) < float("inf")
