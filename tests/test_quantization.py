"""int8/int4 weights and the fp8 KV cache: memory they save, and the quality they keep, vs float32.

The bounds were set from measurements on the built-in model (SmolLM2-135M, CPU, float32
activations), with headroom; the measured values are noted beside them and in the messages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from llmpool import capacity, plan
from llmpool.engine import SamplingParams, scoring
from llmpool.engine.config import QUANTIZATIONS, EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.models.quantization import quantize_rows_int8, weight_bytes
from tests.conftest import FLOAT32_ENGINE, float32_engine

pytestmark = pytest.mark.slow


PERPLEXITY_TEXT = (
    "The river begins high in the mountains, where snow melts in late spring and runs down in"
    " narrow streams. By the time it reaches the valley it is wide and slow, and the towns along"
    " its banks have used it for centuries: to drive mills, to carry timber and grain, and to"
    " bring water to the fields in dry summers. In the nineteenth century engineers straightened"
    " several of its bends to make room for railways and factories, and floods became more"
    " frequent downstream. Today some of those bends are being restored. Wetlands hold back the"
    " water after heavy rain, birds have returned to the reed beds, and the towns have learned"
    " that a river given room to spread is a river that does less damage when it does."
)
AGREEMENT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three benefits of regular exercise are",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "Photosynthesis is the process by which",
    "My favourite programming language is",
]
NEW_TOKENS = 16

# Measured on 2026-11-29: int8 weights 3.97x smaller (538,060,032 -> 135,439,104 bytes); greedy
# agreement int8 0.77, fp8 KV 0.67; perplexity float32 31.61, int8 31.46, fp8 KV 32.07 (+1.5%).
# fp8 KV with scales calibrated at load (2026-12-01): 32.17 (+1.8%; 32.26 at scale 1.0).
INT8_MIN_AGREEMENT = 0.5  # mean share of the 16 greedy tokens before the first divergence
INT8_MAX_PERPLEXITY_RATIO = 1.05
# int4 (groups of 32) on 2026-12-01: 95,003,904 bytes (5.66x smaller), agreement 0.96, perplexity
# 31.20 (0.99x): the built-in model is a dequantized Q4_1 file, whose grid groups of 32 land on.
# int8 with the bfloat16 decode kernel and split-int8 prefill (same day): agreement 0.80, 31.47.
INT4_MIN_AGREEMENT = 0.75
INT4_MAX_PERPLEXITY_RATIO = 1.03
# Tensor bytes of llama.cpp's SmolLM2-135M-Instruct.Q4_1.gguf, the built-in model's source (layers
# Q4_1, the tied embedding / head Q8_0): what its decode step reads.
LLAMA_CPP_Q4_1_BYTES = 96_576_768
ROOT = Path(__file__).parent.parent
FP8_MAX_PERPLEXITY_RATIO = 1.03


@pytest.fixture(scope="module")
def int8_engine() -> EngineCore:
    return float32_engine(quantization="int8")


@pytest.fixture(scope="module")
def int4_engine() -> EngineCore:
    return float32_engine(quantization="int4")


def perplexity(core: EngineCore, text: str) -> float:
    """exp(mean NLL) of every next token of ``text``, in one forward through the paged cache."""
    return scoring.perplexity(core, core.tokenizer.encode(text))


def greedy(core: EngineCore, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        core.add_request(str(index), core.tokenizer.encode(prompt), params)
        outputs[str(index)] = []
    while core.has_unfinished_requests():
        for delta in core.step():
            outputs[delta.request_id] += delta.new_token_ids
    return [outputs[str(i)] for i in range(len(prompts))]


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Mean share of each reference continuation reproduced before the first different token."""
    shares = []
    for expected, got in zip(reference, candidate, strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b), len(expected)
        )
        shares.append(same / len(expected))
    return sum(shares) / len(shares)


def test_int8_rows_round_trip_within_half_a_step() -> None:
    weight = torch.randn(64, 96)
    quantized, scale = quantize_rows_int8(weight)
    assert quantized.dtype == torch.int8 and scale.shape == (64,)
    error = (quantized.float() * scale[:, None] - weight).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-6).all())
    # The layers' outputs against this dequantized weight: tests/test_int4.py.


def test_int8_weights_are_at_least_3_5x_smaller(
    fp32_engine: EngineCore, int8_engine: EngineCore
) -> None:
    ratio = weight_bytes(fp32_engine.model) / weight_bytes(int8_engine.model)
    assert ratio >= 3.5, f"int8 weights are {ratio:.2f}x smaller than float32"
    # The plan's estimate of int8 weights is within 2% of what the engine holds.
    estimate = capacity.weight_bytes(int8_engine.capacity_shape, "float32", "int8")
    assert abs(weight_bytes(int8_engine.model) / estimate - 1) < 0.02


@pytest.mark.parametrize(
    ("quantization", "min_agreement", "max_perplexity_ratio"),
    [
        ("int8", INT8_MIN_AGREEMENT, INT8_MAX_PERPLEXITY_RATIO),
        ("int4", INT4_MIN_AGREEMENT, INT4_MAX_PERPLEXITY_RATIO),
    ],
)
def test_greedy_agreement_and_perplexity(
    fp32_engine: EngineCore,
    request: pytest.FixtureRequest,
    quantization: str,
    min_agreement: float,
    max_perplexity_ratio: float,
) -> None:
    quantized_engine: EngineCore = request.getfixturevalue(f"{quantization}_engine")
    share = agreement(
        greedy(fp32_engine, AGREEMENT_PROMPTS), greedy(quantized_engine, AGREEMENT_PROMPTS)
    )
    assert share >= min_agreement, f"{quantization} greedy agreement {share:.3f}"
    reference, quantized = (
        perplexity(fp32_engine, PERPLEXITY_TEXT),
        perplexity(quantized_engine, PERPLEXITY_TEXT),
    )
    assert quantized / reference <= max_perplexity_ratio, (
        f"perplexity float32 {reference:.3f}, {quantization} {quantized:.3f}"
    )


def test_fp8_kv_cache_holds_twice_the_blocks_of_bfloat16(fp8_kv_engine: EngineCore) -> None:
    memory = EngineConfig(kv_cache_memory=FLOAT32_ENGINE["kv_cache_memory"]).kv_cache_memory
    bf16_blocks = capacity.num_kv_blocks(fp8_kv_engine.capacity_shape, "bfloat16", 16, memory)
    fp8_blocks = fp8_kv_engine.kv_cache_manager.num_total_blocks
    assert fp8_blocks >= 1.9 * bf16_blocks, f"{fp8_blocks} fp8 blocks, {bf16_blocks} bfloat16"
    cache_bytes = sum(t.numel() * t.element_size() for kv in fp8_kv_engine.kv_caches for t in kv)
    assert fp8_kv_engine.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert cache_bytes <= memory


def test_fp8_kv_cache_perplexity(fp32_engine: EngineCore, fp8_kv_engine: EngineCore) -> None:
    reference, fp8 = (
        perplexity(fp32_engine, PERPLEXITY_TEXT),
        perplexity(fp8_kv_engine, PERPLEXITY_TEXT),
    )
    assert fp8 / reference <= FP8_MAX_PERPLEXITY_RATIO, (
        f"perplexity float32 {reference:.3f}, fp8 KV {fp8:.3f}"
    )


def test_plan_reflects_quantization_and_kv_dtype() -> None:
    bf16 = plan.make_plan("builtin://smollm2-135m-instruct", 2 * 1024**3, 4096)
    small = plan.make_plan(
        "builtin://smollm2-135m-instruct",
        2 * 1024**3,
        4096,
        kv_cache_dtype="fp8",
        quantization="int8",
    )
    assert bf16.weight_bytes == 2 * small.weight_bytes
    assert small.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert small.num_kv_blocks >= 1.9 * bf16.num_kv_blocks
    assert small.max_concurrent_sequences > bf16.max_concurrent_sequences
    assert plan.main(["--memory", "100MB"]) == 1  # the weights alone do not fit


def test_fp8_weights_are_not_an_option() -> None:
    """Offered nowhere (CLI, CRD, plan), so never accepted and then refused at start."""
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4, got 'fp8'"):
        EngineConfig(quantization="fp8")


def test_int4_weights_read_less_per_decode_step_than_llama_cpp_q4_1(
    fp32_engine: EngineCore, int4_engine: EngineCore
) -> None:
    held = weight_bytes(int4_engine.model)
    assert held < LLAMA_CPP_Q4_1_BYTES, f"int4 holds {held:,} bytes"
    ratio = weight_bytes(fp32_engine.model) / held
    assert ratio >= 5.5, f"int4 weights are {ratio:.2f}x smaller than float32"
    estimate = capacity.weight_bytes(int4_engine.capacity_shape, "float32", "int4")
    assert abs(held / estimate - 1) < 0.02


def test_every_quantization_is_offered_by_config_plan_and_crd() -> None:
    assert tuple(capacity.QUANTIZATION_BYTES) == QUANTIZATIONS
    for crd in ("crds/llmpool.yaml", "charts/llmpool/crds/llmpool.yaml"):
        schema = yaml.safe_load((ROOT / crd).read_text())["spec"]["versions"][0]["schema"]
        spec = schema["openAPIV3Schema"]["properties"]["spec"]["properties"]
        assert spec["quantization"]["enum"] == list(QUANTIZATIONS), crd
    for quantization in QUANTIZATIONS:
        assert EngineConfig(quantization=quantization).quantization == quantization
        assert plan.main(["--memory", "2GiB", "--quantization", quantization]) == 0
    sizes = {
        q: plan.make_plan("builtin://smollm2-135m-instruct", 2 * 1024**3, 4096, quantization=q)
        for q in QUANTIZATIONS
    }
    assert sizes["int4"].weight_bytes < sizes["int8"].weight_bytes < sizes["none"].weight_bytes
    assert sizes["int4"].weight_bytes < LLAMA_CPP_Q4_1_BYTES
