"""CPU GEMM choices of ``models.linear``: each equals a plain matmul of the same operands."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.models import linear

IN, OUT = 576, 320


@pytest.fixture(autouse=True)
def restore_upcast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "_bfloat16_upcast_min_rows", linear.bfloat16_upcast_min_rows())


def operands(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, IN, generator=generator).to(dtype)
    weight = (torch.randn(OUT, IN, generator=generator) / IN**0.5).to(dtype)
    bias = torch.randn(OUT, generator=generator).to(dtype)
    return x, weight, bias


@pytest.mark.parametrize("rows", [1, 16, 64, 65, 300])
def test_float32_equals_the_plain_linear(rows: int) -> None:
    x, weight, bias = operands(rows, torch.float32)
    torch.testing.assert_close(
        linear.linear(x, weight, bias), nn.functional.linear(x, weight, bias)
    )


@pytest.mark.parametrize("rows", [1, 16, 127])
def test_bfloat16_below_the_threshold_runs_in_bfloat16(rows: int) -> None:
    linear.set_bfloat16_upcast(128)
    x, weight, bias = operands(rows, torch.bfloat16)
    assert torch.equal(linear.linear(x, weight, bias), nn.functional.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [128, 300])
def test_bfloat16_from_the_threshold_runs_in_float32_and_is_no_less_exact(rows: int) -> None:
    linear.set_bfloat16_upcast(128)
    x, weight, bias = operands(rows, torch.bfloat16)
    out = linear.linear(x, weight, bias)
    assert out.dtype == torch.bfloat16
    expected = nn.functional.linear(x.float(), weight.float(), bias.float())
    assert torch.equal(out, expected.to(torch.bfloat16))
    exact = nn.functional.linear(x.double(), weight.double(), bias.double())
    native = nn.functional.linear(x, weight, bias)
    upcast_error = (out.double() - exact).abs().mean()
    native_error = (native.double() - exact).abs().mean()
    assert upcast_error <= native_error * 1.05, (upcast_error, native_error)


def test_without_upcast_every_size_runs_in_bfloat16() -> None:
    linear.set_bfloat16_upcast(None)
    x, weight, bias = operands(300, torch.bfloat16)
    assert torch.equal(linear.linear(x, weight, bias), nn.functional.linear(x, weight, bias))


def test_the_probe_measures_a_positive_ratio() -> None:
    _, weight, _ = operands(1, torch.bfloat16)
    speedup = linear.probe_bfloat16_upcast(weight, rows=64, repeats=3)
    assert 0 < speedup < float("inf")


@pytest.mark.parametrize(("speedup", "expected"), [(2.0, 128), (1.0, None)])
def test_a_bfloat16_engine_upcasts_as_its_probe_says(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    speedup: float,
    expected: int | None,
) -> None:
    probed: list[torch.Size] = []

    def probe(weight: torch.Tensor) -> float:
        probed.append(weight.shape)
        return speedup

    monkeypatch.setattr(linear, "probe_bfloat16_upcast", probe)
    linear.set_bfloat16_upcast(64)
    with caplog.at_level(logging.INFO, logger="llmpool.engine.engine_core"):
        core = EngineCore(
            EngineConfig(dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB")
        )
    assert probed == [core.model.layers[0].gate_up_proj.weight.shape]
    assert linear.bfloat16_upcast_min_rows() == expected
    assert f"{speedup:.2f}x as fast" in caplog.text


def test_a_float32_engine_does_not_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "probe_bfloat16_upcast", pytest.fail)
    EngineCore(EngineConfig(dtype="float32", max_model_len=256, kv_cache_memory="16MiB"))
