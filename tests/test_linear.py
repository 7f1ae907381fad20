"""CPU GEMM choices of ``models.linear``: each equals a plain matmul of the same operands, up to
summation order."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.kernels import avx2_gemm, bf16_gemm, cpu_share
from llmpool.engine.kernels.capabilities import bfloat16_kernel, decodes_in_c
from llmpool.engine.models import linear
from llmpool.engine.models.linear import GemmChoice
from tests.conftest import needs_cpu

IN, OUT = 576, 320

needs_kernel = needs_cpu()


UPCAST_128 = GemmChoice(bfloat16_upcast_min_rows=128)


def operands(
    rows: int, dtype: torch.dtype, inputs: int = IN, outputs: int = OUT
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 7919 + inputs + outputs)
    x = torch.randn(rows, inputs, generator=generator).to(dtype)
    weight = (torch.randn(outputs, inputs, generator=generator) / inputs**0.5).to(dtype)
    bias = torch.randn(outputs, generator=generator).to(dtype)
    return x, weight, bias


def assert_no_less_exact(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``out``'s error against the float64 product is at most that of torch's bfloat16 GEMM."""
    exact = nn.functional.linear(x.double(), weight.double())
    native = nn.functional.linear(x, weight)
    error = (out.double() - exact).abs().mean()
    native_error = (native.double() - exact).abs().mean()
    assert error <= native_error * 1.05, (error, native_error)


@pytest.mark.parametrize("rows", [1, 16, 64, 65, 300])
def test_float32_equals_the_plain_linear(rows: int) -> None:
    x, weight, bias = operands(rows, torch.float32)
    torch.testing.assert_close(
        linear.linear(x, weight, bias), nn.functional.linear(x, weight, bias)
    )


@pytest.mark.parametrize("rows", [1, 16, 127])
def test_bfloat16_below_the_threshold_runs_in_bfloat16(rows: int) -> None:
    x, weight, bias = operands(rows, torch.bfloat16)
    out = linear.linear(x, weight, bias, UPCAST_128)
    assert torch.equal(out, nn.functional.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [128, 300])
def test_bfloat16_from_the_threshold_runs_in_float32_and_is_no_less_exact(rows: int) -> None:
    x, weight, bias = operands(rows, torch.bfloat16)
    out = linear.linear(x, weight, bias, UPCAST_128)
    assert out.dtype == torch.bfloat16
    expected = nn.functional.linear(x.float(), weight.float(), bias.float())
    assert torch.equal(out, expected.to(torch.bfloat16))
    exact = nn.functional.linear(x.double(), weight.double(), bias.double())
    native = nn.functional.linear(x, weight, bias)
    upcast_error = (out.double() - exact).abs().mean()
    native_error = (native.double() - exact).abs().mean()
    assert upcast_error <= native_error * 1.05, (upcast_error, native_error)


# Each build the kernel has here, by each of its symbols that runs other code: every build's own
# way (bf16_linear), and the widened way in tiles at every row count (bf16_linear_widened), which
# is the same code in every build.
KERNEL_WAYS = [
    ("this CPU's", "bf16_linear"),
    ("this CPU's", "bf16_linear_widened"),
    *((build, "bf16_linear") for build in bf16_gemm.NARROWER_BUILDS),
]


@needs_kernel
@pytest.mark.parametrize(("build", "symbol"), KERNEL_WAYS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 64, 256])
@pytest.mark.parametrize(
    ("inputs", "outputs"), [(576, 320), (1536, 40), (1536, 7), (100, 4), (31, 5)]
)
def test_the_kernel_is_the_float32_product_rounded_to_bfloat16(
    build: str, symbol: str, rows: int, inputs: int, outputs: int
) -> None:
    """Every tile shape: the few-row paths (1-2 rows widening, 1-4 with vdpbf16ps), 4-row tiles
    with remainders and tiles of 1-3 rows (the widened way's few rows), outputs past a multiple
    of 4, inputs of whole 32-element chunks, a tail, and a tail alone; on AMX, tiles of 16 x rows
    in groups of up to 4 with a part-filled last tile, and outputs past whole 16-row blocks; in
    every build this CPU runs (a narrower build that is this CPU's own is tested again)."""
    x, weight, _ = operands(rows, torch.bfloat16, inputs, outputs)
    library = None if build == "this CPU's" else bf16_gemm.narrower_build(build)
    out = bf16_gemm.bf16_linear(x, weight, library, symbol)
    assert out.dtype == torch.bfloat16
    assert out.shape == (rows, outputs)
    product = nn.functional.linear(x.float(), weight.float())
    # float32 sums differing only in order, each rounded once to bfloat16 (2^-8 relative)
    torch.testing.assert_close(out.float(), product, rtol=2**-8, atol=1e-6)
    assert_no_less_exact(out, x, weight)


@needs_kernel
def test_the_kernel_takes_strided_rows_and_refuses_other_dtypes() -> None:
    x, weight, _ = operands(8, torch.bfloat16)
    strided = torch.cat([x, x], dim=1)[:, :IN]
    assert torch.equal(bf16_gemm.bf16_linear(strided, weight), bf16_gemm.bf16_linear(x, weight))
    assert bf16_gemm.bf16_linear(x[:0], weight).shape == (0, OUT)
    x[3, 5] = float("nan")
    out = bf16_gemm.bf16_linear(x, weight)
    assert out[3].isnan().all() and not out[[0, 1, 2, 4]].isnan().any()
    with pytest.raises(ValueError, match="bfloat16"):
        bf16_gemm.bf16_linear(x.float(), weight.float())
    with pytest.raises(ValueError, match="shapes"):
        bf16_gemm.bf16_linear(x[:, :-1], weight)


@needs_kernel
def test_with_the_kernel_bfloat16_runs_in_it_up_to_its_rows_then_in_float32() -> None:
    gemm = GemmChoice(bfloat16_kernel_max_rows=128, bfloat16_upcast_min_rows=128)
    for rows in (1, 16, 128):
        x, weight, bias = operands(rows, torch.bfloat16)
        expected = bf16_gemm.bf16_linear(x, weight) + bias
        assert torch.equal(linear.linear(x, weight, bias, gemm), expected)
    x, weight, bias = operands(129, torch.bfloat16)
    expected = nn.functional.linear(x.float(), weight.float(), bias.float())
    assert torch.equal(linear.linear(x, weight, bias, gemm), expected.to(torch.bfloat16))


@needs_kernel
def test_linear_runs_the_widened_kernel_where_it_was_chosen() -> None:
    gemm = GemmChoice(bfloat16_kernel_max_rows=128, bfloat16_kernel="bf16_gemm_widened")
    for rows in (1, 16, 128):
        x, weight, bias = operands(rows, torch.bfloat16)
        expected = bf16_gemm.bf16_linear_widened(x, weight) + bias
        assert torch.equal(linear.linear(x, weight, bias, gemm), expected)


def test_without_upcast_every_size_runs_in_bfloat16() -> None:
    x, weight, bias = operands(300, torch.bfloat16)
    assert torch.equal(linear.linear(x, weight, bias), nn.functional.linear(x, weight, bias))


def test_the_probes_measure_positive_ratios() -> None:
    _, weight, _ = operands(1, torch.bfloat16)
    speedup = linear.probe_bfloat16_upcast(weight, rows=64, repeats=3)
    assert 0 < speedup < float("inf")
    if bf16_gemm.KERNEL.available:
        speedup = linear.probe_bfloat16_kernel([weight], "bf16_gemm", rows=16, repeats=3)
        assert 0 < speedup < float("inf")


def test_a_probe_streams_copies_of_its_weight_past_the_cache() -> None:
    _, weight, _ = operands(1, torch.bfloat16)
    weights = linear.streamed(weight)
    size = weight.numel() * weight.element_size()
    assert linear.PROBE_STREAM_BYTES <= len(weights) * size < linear.PROBE_STREAM_BYTES + size
    assert len({w.data_ptr() for w in weights}) == len(weights)
    assert all(torch.equal(w, weight) for w in weights)


@pytest.mark.parametrize(
    ("kernel_speedups", "kernel_rows", "upcast_speedup", "upcast_rows"),
    [
        ({8: 2.0, 16: 2.0, 32: 2.0, 64: 2.0, 128: 2.0}, 128, 2.0, 128),  # the Xeon without AMX
        ({8: 1.5, 16: 1.2, 32: 0.9}, 16, 0.4, None),  # a Zen 4 EPYC
        ({8: 0.5}, None, 1.0, None),  # oneDNN throughout
        # The kernel's vdpbf16ps build on an Intel Xeon with AMX (Linux refusing it the tiles):
        # up to 16 rows, as its decode steps run in the C decoder.
        ({8: 1.45, 16: 0.75, 32: 0.57}, 16, 0.18, None),
    ],
)
def test_a_bfloat16_engine_runs_the_gemms_its_probes_choose(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kernel_speedups: dict[int, float],
    kernel_rows: int | None,
    upcast_speedup: float,
    upcast_rows: int | None,
) -> None:
    """The kernel's probe climbs the row counts on streamed weights until the kernel stops
    winning by 1.1x; the upcast's probe runs once; the layers hold what they chose. The kernel
    probes share one set of streamed copies (64 MiB, made once a start)."""
    probed: list[tuple[str, torch.Size, int | None]] = []
    widened_probed: list[tuple[str, str, int]] = []
    streamed_lists: list[list[torch.Tensor]] = []  # kept alive, so that none is new by chance

    def kernel_probe(
        weights: list[torch.Tensor], kernel: str, rows: int, against: str | None = None
    ) -> float:
        assert sum(w.numel() * w.element_size() for w in weights) >= linear.PROBE_STREAM_BYTES
        if not any(weights is seen for seen in streamed_lists):
            streamed_lists.append(weights)
        if against is not None:  # the widened way against the build's own: no faster
            widened_probed.append((kernel, against, rows))
            return 1.0
        probed.append((kernel, weights[0].shape, rows))
        return kernel_speedups[rows]

    def upcast_probe(weight: torch.Tensor) -> float:
        probed.append(("upcast", weight.shape, None))
        return upcast_speedup

    monkeypatch.setattr(linear, "probe_bfloat16_upcast", upcast_probe)
    monkeypatch.setattr(linear, "probe_bfloat16_kernel", kernel_probe)
    monkeypatch.setattr(linear, "probe_float32_kernel", pytest.fail)
    monkeypatch.setattr(cpu_share, "neighbour_share", lambda run: (run(), 0.0))  # a quiet CPU
    with caplog.at_level(logging.INFO, logger="llmpool.engine.kernels.capabilities"):
        core = EngineCore(
            EngineConfig(dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB")
        )
    kernel = bfloat16_kernel(core.kernels)
    in_c_decoder_only = kernel_rows == 16 and kernel_speedups[16] < 1.1  # the AMX case
    if in_c_decoder_only and not decodes_in_c(core.kernels):
        pytest.skip("the C decoder is not built here (it needs AVX2 and a C compiler)")
    shape = core.model.layers[0].gate_up_proj.weight.shape
    climbed = [(kernel, shape, rows) for rows in kernel_speedups] if kernel else []
    assert probed == [*climbed, ("upcast", shape, None)]
    widened_probes = [("bf16_gemm_widened", "bf16_gemm", rows) for rows in (32, 1)]
    assert widened_probed == (widened_probes if kernel == "bf16_gemm" else [])
    assert len(streamed_lists) == (1 if kernel else 0)
    expected_kernel_rows = kernel_rows if kernel else None
    assert core.kernels.gemm == GemmChoice(expected_kernel_rows, upcast_rows, kernel or "bf16_gemm")
    assert core.kernels.gemm.as_observed() == {  # what /fingerprint reports
        "bfloat16Kernel": kernel if expected_kernel_rows else None,
        "bfloat16KernelMaxRows": expected_kernel_rows,
        "bfloat16UpcastMinRows": upcast_rows,
        "float32KernelMaxRows": None,
    }
    projection = core.model.layers[0].gate_up_proj
    assert projection.gemm is core.kernels.gemm is core.model.gemm
    assert f"float32 runs 256 rows {upcast_speedup:.2f}x as fast" in caplog.text
    if kernel:
        rows, speedup = list(kernel_speedups.items())[-1]
        assert f"{rows} rows {speedup:.2f}x as fast" in caplog.text


@pytest.mark.parametrize(
    ("speedup", "expected"), [(2.0, linear.FLOAT32_KERNEL_MAX_ROWS), (1.0, None)]
)
def test_a_float32_engine_probes_the_float32_kernel_alone(
    monkeypatch: pytest.MonkeyPatch, speedup: float, expected: int | None
) -> None:
    probed: list[torch.Size] = []

    def probe(weight: torch.Tensor) -> float:
        assert weight.dtype == torch.float32
        probed.append(weight.shape)
        return speedup

    monkeypatch.setattr(linear, "probe_bfloat16_upcast", pytest.fail)
    monkeypatch.setattr(linear, "probe_bfloat16_kernel", pytest.fail)
    monkeypatch.setattr(linear, "probe_float32_kernel", probe)
    monkeypatch.setattr(cpu_share, "neighbour_share", lambda run: (run(), 0.0))
    core = EngineCore(EngineConfig(dtype="float32", max_model_len=256, kv_cache_memory="16MiB"))
    built = avx2_gemm.KERNEL.available
    shape = core.model.layers[0].gate_up_proj.weight.shape
    assert probed == [shape] * built
    assert core.kernels.gemm == GemmChoice(float32_kernel_max_rows=expected if built else None)
    assert core.kernels.gemm.as_observed()["float32KernelMaxRows"] == (expected if built else None)
