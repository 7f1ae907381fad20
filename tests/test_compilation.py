"""Compiling the decoder: which sizes are compiled at start, and what is refused up front.

That the compiled decoder generates what transformers does, and compiles nothing after start,
is ``test_engine_vs_hf.py``'s "compiled" configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from llmpool.engine import LLM, SamplingParams, compilation
from llmpool.engine.kernels.capabilities import bfloat16_kernel, probe_kernels
from llmpool.engine.models import linear
from llmpool.engine.models.linear import GemmChoice
from tests.conftest import small_config


def test_sizes_cover_one_token_each_power_of_two_one_past_it_and_the_largest() -> None:
    assert compilation.compile_sizes(1) == [1]
    assert compilation.compile_sizes(10) == [1, 2, 3, 4, 5, 8, 9, 10]
    sizes = compilation.compile_sizes(2048)
    assert sizes[:5] == [1, 2, 3, 4, 5]
    assert {8, 9, 64, 65, 1024, 1025, 2048} <= set(sizes)
    assert max(sizes) == 2048


def test_compile_is_refused_off_cpu_and_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    compilation.check_can_compile(torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA graphs are not built yet"):
        compilation.check_can_compile(torch.device("cuda"))
    monkeypatch.setattr(compilation.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        compilation.check_can_compile(torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_compiled_quantized_float32_agrees_with_eager_in_one_graph(
    quantization: str, save_small_checkpoint: Callable[[Any, Path], Path], tmp_path: Path
) -> None:
    """Quantized decodes run kernels whose scales a compiled graph must read as tensors
    (lowering ``scale.to(bfloat16)`` inside it failed): the VNNI kernels as the opaque ops
    ``llmpool::int8_linear`` / ``int4_linear``, or torch's bfloat16 ones. Whether the VNNI
    kernels run is a flag settled before compiling: tracing its first check (which builds them)
    broke the graph and left the decoder eager, which agreement alone cannot see. The float32
    around the kernels is fused in a different order and may flip near-ties, so the bound is
    agreement, as for int8 against float32. A 2-layer random Llama: the graph unrolls every
    layer, and the built-in model's 30 took minutes to compile; the layers are the same code."""
    model = save_small_checkpoint(small_config(LlamaConfig), tmp_path / "model")
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a poem about the sea." * 6]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    tokens = {
        compiled: [
            output.outputs[0].token_ids
            for output in LLM(
                str(model),
                dtype="float32",
                quantization=quantization,
                compile=compiled,
                max_num_batched_tokens=8,
            ).generate(prompts, params)
        ]
        for compiled in (False, True)
    }
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks_before
    agree = sum(
        a == b
        for eager, compiled in zip(tokens[False], tokens[True], strict=True)
        for a, b in zip(eager, compiled, strict=True)
    )
    assert agree / sum(map(len, tokens[False])) >= 0.8


@pytest.mark.slow
@pytest.mark.parametrize("widened_speedup", [1.0, 2.0], ids=["own-way", "widened"])
def test_compiled_bfloat16_gemm_choices_compile_nothing_after_start(
    monkeypatch: pytest.MonkeyPatch,
    save_small_checkpoint: Callable[[Any, Path], Path],
    tmp_path: Path,
    widened_speedup: float,
) -> None:
    """Decodes and chunks of up to 128 rows take ``linear``'s C-kernel branch (an opaque op in
    the graph: bf16_gemm's own way or its widened one, as the probe chooses) where the kernel is
    built, larger prefill chunks its upcast branch: size branches that the start-up compile must
    have covered, and the same functions as eager. On a 2-layer random Llama, as above."""
    model = save_small_checkpoint(small_config(LlamaConfig), tmp_path / "model")
    kernel = bfloat16_kernel(probe_kernels(torch.device("cpu")))
    if kernel == "bf16_gemm" and widened_speedup > 1:
        kernel = "bf16_gemm_widened"

    def speedup(
        weights: list[torch.Tensor], kernel: str, rows: int, against: str | None = None
    ) -> float:
        return 2.0 if against is None else widened_speedup

    monkeypatch.setattr(linear, "probe_bfloat16_upcast", lambda weight: 2.0)
    monkeypatch.setattr(linear, "probe_bfloat16_kernel", speedup)
    # ~450 tokens, so the prefill takes the upcast branch; not a repeated phrase, whose
    # continuations are near-ties that bfloat16 rounding (fused or not) flips
    prompts = [", ".join(str(number) for number in range(120)), "The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for compiled in (False, True):
        llm = LLM(
            str(model),
            dtype="bfloat16",
            compile=compiled,
            max_num_batched_tokens=512,
            # a cache of this test's own: the GEMM choice stored beside it would stand for the
            # other parametrization's start (capabilities.stored_or_probed)
            compile_cache_dir=str(tmp_path / "compile"),
        )
        assert llm.engine.kernels.gemm == GemmChoice(
            linear.BFLOAT16_KERNEL_MAX_ROWS if kernel else None,
            linear.BFLOAT16_UPCAST_MIN_ROWS,
            kernel or "bf16_gemm",
        )
        graphs_before = compilation.num_compiled_graphs()
        tokens[compiled] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        assert compilation.num_compiled_graphs() == graphs_before
    agree = sum(
        a == b
        for eager, compiled in zip(tokens[False], tokens[True], strict=True)
        for a, b in zip(eager, compiled, strict=True)
    )
    assert agree / sum(map(len, tokens[False])) >= 0.8
