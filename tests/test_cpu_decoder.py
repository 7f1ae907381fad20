"""The C decoder (``cpu_decoder.c``) against the layer-by-layer forward it stands in for: every
decode step's hidden states and KV-cache writes bit for bit, on small random models and on the
built-in model while it generates; and greedy parity with HF transformers through it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from llmpool.engine import LLM, SamplingParams
from llmpool.engine.attention import TORCH, AttentionMetadata, Backend, cpu_backend_with
from llmpool.engine.kernels import cpu_decoder
from llmpool.engine.kernels.capabilities import (
    KernelCapabilities,
    bfloat16_kernel,
    probe_kernels,
)
from llmpool.engine.models.linear import TORCH_GEMMS, GemmChoice
from llmpool.engine.models.llama import LlamaForCausalLM, LlamaShape
from llmpool.engine.models.quantization import INT8_VNNI_MAX_ROWS, quantize
from tests.conftest import needs_avx2, needs_cpu
from tests.paged_batches import scattered_batch

pytestmark = needs_avx2()  # a few-row C GEMM: avx2_gemm, or bf16_gemm on AVX-512

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
Caches = list[tuple[torch.Tensor, torch.Tensor]]


def with_c_gemm(
    kernels: KernelCapabilities,
    dtype: torch.dtype,
    max_rows: int = 16,
    bfloat16_kernel_name: str | None = None,
) -> KernelCapabilities:
    """``kernels`` with decode rows of ``dtype`` in this CPU's C GEMM (bfloat16: the kernel
    ``bfloat16_kernel_name``, by default the build's own way), whatever a probe says."""
    if dtype == torch.bfloat16:
        gemm = GemmChoice(
            bfloat16_kernel_max_rows=max_rows,
            bfloat16_kernel=bfloat16_kernel_name or bfloat16_kernel(kernels),
        )
    else:
        gemm = GemmChoice(float32_kernel_max_rows=max_rows)
    return replace(kernels, gemm=gemm)


def small_shape(head_dim: int, qkv_bias: bool) -> LlamaShape:
    """Grouped-query attention (3 query heads a KV head) over 3 layers; at head_dim 64 every
    projection's sizes suit the int4 kernel's groups and blocks."""
    return LlamaShape(
        vocab_size=300, hidden_size=128, intermediate_size=192, num_layers=3, num_heads=6,
        num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=512, qkv_bias=qkv_bias,
        tie_word_embeddings=False,
    )  # fmt: skip


def small_model(
    shape: LlamaShape,
    dtype: torch.dtype,
    kernels: KernelCapabilities,
    quantization: str = "none",
) -> LlamaForCausalLM:
    """Random weights, quantized (from float32) and cast as the engine loads a checkpoint."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(shape, cpu_backend_with(kernels), 512, kernels.gemm)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    quantize(model, quantization, kernels)
    model = model.to(dtype).eval()
    model.use_kernels(kernels)
    return model


def random_caches(
    shape: LlamaShape, num_blocks: int, block_size: int, dtype: torch.dtype
) -> Caches:
    size = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    return [
        (torch.randn(size).to(dtype), torch.randn(size).to(dtype)) for _ in range(shape.num_layers)
    ]


def layer_by_layer(model: LlamaForCausalLM, *inputs: object) -> torch.Tensor:
    decoder, model.cpu_decoder = model.cpu_decoder, None
    try:
        return model(*inputs)
    finally:
        model.cpu_decoder = decoder


def assert_caches_equal(actual: Caches, expected: Caches) -> None:
    for (key, value), (expected_key, expected_value) in zip(actual, expected, strict=True):
        assert torch.equal(key, expected_key) and torch.equal(value, expected_value)


def assert_a_step_equals_the_layer_by_layer_forward(
    model: LlamaForCausalLM, dtype: torch.dtype, seq_lens: list[int]
) -> None:
    """One decode step of ``seq_lens`` contexts over caches of random K and V: the C decoder's
    hidden states and cache writes against the layer-by-layer forward's, bit for bit."""
    shape = model.shape
    batch = scattered_batch(seq_lens, [1] * len(seq_lens), block_size=16, seed=3)
    caches = random_caches(shape, batch.num_blocks, 16, dtype)
    expected_caches = [(key.clone(), value.clone()) for key, value in caches]
    input_ids = torch.randint(0, shape.vocab_size, (len(seq_lens),))
    positions = torch.tensor(seq_lens) - 1
    assert model.cpu_decoder is not None and model.cpu_decoder.takes(batch.meta, model.backend)

    hidden = model(input_ids, positions, caches, batch.meta)
    expected = layer_by_layer(model, input_ids, positions, expected_caches, batch.meta)
    assert hidden.dtype == dtype and torch.equal(hidden, expected)
    assert_caches_equal(caches, expected_caches)


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 24])  # the attention kernel's own build for 64; any
@pytest.mark.parametrize("qkv_bias", [False, True])  # Qwen2's biased QKV
def test_a_decode_step_equals_the_layer_by_layer_forward(
    dtype: torch.dtype, head_dim: int, qkv_bias: bool
) -> None:
    kernels = with_c_gemm(probe_kernels(torch.device("cpu")), dtype)
    model = small_model(small_shape(head_dim, qkv_bias), dtype, kernels)
    # The new token alone, contexts at block edges and over many blocks.
    assert_a_step_equals_the_layer_by_layer_forward(model, dtype, [1, 16, 17, 40, 300])


@needs_cpu()  # bf16_gemm: AVX-512
def test_a_decode_step_through_the_widened_kernel_equals_the_layer_by_layer_forward() -> None:
    """The widened way of bf16_gemm (the start-up probe's choice on Intel CPUs without AMX),
    called from C by its own symbol."""
    kernels = with_c_gemm(
        probe_kernels(torch.device("cpu")), torch.bfloat16, bfloat16_kernel_name="bf16_gemm_widened"
    )
    model = small_model(small_shape(64, False), torch.bfloat16, kernels)
    assert_a_step_equals_the_layer_by_layer_forward(model, torch.bfloat16, [1, 17, 40, 300])


@needs_cpu("avx512_vnni", "avx512vbmi")  # vnni_gemm's int8 and int4 decodes
@DTYPES
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_a_quantized_decode_step_equals_the_layer_by_layer_forward(
    dtype: torch.dtype, quantization: str, qkv_bias: bool
) -> None:
    kernels = probe_kernels(torch.device("cpu"))  # the dense GEMMs' choice is not asked
    model = small_model(small_shape(64, qkv_bias), dtype, kernels, quantization)
    # int4: up to the rows from which the layers dequantize (more where its rows run on tiles)
    max_rows = (
        INT8_VNNI_MAX_ROWS if quantization == "int8" else kernels.int4_dequantized_min_rows - 1
    )
    assert model.cpu_decoder is not None and model.cpu_decoder.max_rows == max_rows
    # int4: more rows than the kernel's tile of 6
    assert_a_step_equals_the_layer_by_layer_forward(model, dtype, [300, 17, 40, 1, 16, 33, 5, 64])


def decode_meta(rows: int) -> AttentionMetadata:
    return scattered_batch([8] * rows, [1] * rows, block_size=16, seed=0).meta


def test_steps_it_does_not_take() -> None:
    kernels = with_c_gemm(probe_kernels(torch.device("cpu")), torch.float32, max_rows=4)
    model = small_model(small_shape(64, False), torch.float32, kernels)
    decoder = model.cpu_decoder
    assert decoder is not None and decoder.takes(decode_meta(4), model.backend)
    assert not decoder.takes(
        decode_meta(5), model.backend
    )  # more rows than the C GEMM is chosen for
    assert not decoder.takes(
        scattered_batch([8, 8], [1, 3], 16, seed=0).meta, model.backend
    )  # a prefill
    model.backend = cpu_backend_with(kernels)  # another backend: its kernels, layer by layer
    assert not decoder.takes(decode_meta(4), model.backend)


def test_models_it_does_not_run() -> None:
    kernels = with_c_gemm(probe_kernels(torch.device("cpu")), torch.float32)
    shape = small_shape(64, False)
    model = small_model(shape, torch.float32, kernels)
    assert cpu_decoder.for_model(model, kernels) is not None
    assert cpu_decoder.for_model(model, replace(kernels, gemm=TORCH_GEMMS)) is None
    assert cpu_decoder.for_model(model, replace(kernels, cpu_decoder=False)) is None
    assert cpu_decoder.for_model(model, replace(kernels, cpu_layer_ops=False)) is None
    model.backend = TORCH
    assert cpu_decoder.for_model(model, kernels) is None
    half = small_model(shape, torch.float16, kernels)
    assert half.cpu_decoder is None
    without_vnni = replace(kernels, vnni_gemm=False)
    assert small_model(shape, torch.float32, without_vnni, "int8").cpu_decoder is None
    assert small_model(shape, torch.float32, without_vnni, "int4").cpu_decoder is None


def c_decoded_engine(dtype: str, **config: object) -> LLM:
    llm = LLM(dtype=dtype, enable_prefix_caching=False, **config)
    model = llm.engine.model
    model.use_kernels(with_c_gemm(llm.engine.kernels, model.norm.dtype))
    assert model.cpu_decoder is not None
    return llm


class Checked:
    """A C decoder that also runs each step it takes layer by layer, on copies of the caches,
    and keeps whether the two agreed bit for bit."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        assert model.cpu_decoder is not None
        self.model, self.decoder = model, model.cpu_decoder
        self.rows: list[int] = []

    def takes(self, meta: AttentionMetadata, backend: Backend) -> bool:
        return self.decoder.takes(meta, backend)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        copies = [(key.clone(), value.clone()) for key, value in kv_caches]
        expected = layer_by_layer(self.model, input_ids, positions, copies, meta)
        hidden = self.decoder(input_ids, positions, kv_caches, meta)
        assert torch.equal(hidden, expected)
        assert_caches_equal(list(kv_caches), copies)
        self.rows.append(meta.num_tokens)
        return hidden


BUILTIN_CASES = {
    "bfloat16": ("bfloat16", "none"),
    "float32": ("float32", "none"),
    "int4": pytest.param("bfloat16", "int4", marks=needs_cpu("avx512_vnni", "avx512vbmi")),
}


@pytest.mark.parametrize(("dtype", "quantization"), BUILTIN_CASES.values(), ids=BUILTIN_CASES)
def test_the_builtin_model_decodes_as_layer_by_layer(dtype: str, quantization: str) -> None:
    llm = c_decoded_engine(
        dtype, quantization=quantization, max_model_len=512, kv_cache_memory="64MiB"
    )
    model = llm.engine.model
    checked = Checked(model)
    model.cpu_decoder = checked  # type: ignore[assignment]
    rows = min(4, checked.decoder.max_rows)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
    lengths = [30, 20, 12, 6][:rows]  # the batch shrinks as requests finish: 4 rows, 3, 2, 1
    llm.generate(
        prompts[:rows],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
    )
    assert sorted(set(checked.rows)) == list(range(1, rows + 1))
    assert len(checked.rows) == max(lengths) - 1  # every decode step ran in the C decoder


@pytest.mark.slow
def test_greedy_matches_transformers_through_the_c_decoder(
    hf_greedy_reference: dict, reference_new_tokens: int
) -> None:
    llm = c_decoded_engine("float32", max_model_len=2048)
    prompts = [list(ids) for ids in hf_greedy_reference]
    params = SamplingParams(
        temperature=0, max_tokens=reference_new_tokens, min_tokens=reference_new_tokens
    )
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy_reference[tuple(prompt)]
