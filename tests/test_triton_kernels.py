"""Triton kernels against the torch reference backend, on CPU under the Triton interpreter.

The device is a parameter: ``LLMPOOL_KERNEL_TEST_DEVICE=cuda`` runs the same tests compiled on
a GPU (benchmarks/gpu_check.py does); the default, ``cpu``, turns on ``TRITON_INTERPRET=1``
before Triton is imported, because Triton reads it when a kernel is decorated.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEVICE = os.environ.get("LLMPOOL_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    # triton.language's own helpers (tl.sum, tl.max...) are decorated when triton is imported.
    if "triton" in sys.modules:
        raise RuntimeError(
            "triton was imported before this module could set TRITON_INTERPRET=1; "
            "set TRITON_INTERPRET=1 in the environment (or in tests/conftest.py)"
        )
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the CUDA kernels cannot be tested")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("LLMPOOL_KERNEL_TEST_DEVICE=cuda but no GPU is visible", allow_module_level=True)

from llmpool.engine.attention import (  # noqa: E402
    TORCH,
    check_fp8_capability,
    check_kv_cache_dtype,
    select_backend,
)
from llmpool.engine.attention.triton_backend import TRITON  # noqa: E402
from llmpool.engine.kernels.capabilities import KernelCapabilities, probe_kernels  # noqa: E402
from llmpool.engine.kv_cache import FP8_DTYPE, LayerKVCache, quantize_fp8  # noqa: E402
from tests.conftest import small_config  # noqa: E402
from tests.paged_batches import scattered_batch  # noqa: E402

DTYPE_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get
# fp32 must agree to rounding-order noise; fp16 rounds the softmax probabilities to fp16
# before the P@V product (as on tensor cores), hence the looser bound.
ATTENTION_TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
NUM_KV_HEADS = 2
HEAD_DIM = 64


def test_cuda_selects_the_triton_backend() -> None:
    kernels = probe_kernels(torch.device("cpu"))
    assert select_backend(torch.device("cuda"), kernels=KernelCapabilities()) is TRITON
    assert (
        select_backend(torch.device("cpu"), kernels=kernels).name == "cpu"
    )  # test_torch_attention


@pytest.fixture(params=[DEVICE])
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def _check_attention(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    dtype: torch.dtype,
    queries_per_kv: int,
    block_size: int,
    device: torch.device,
    head_dim: int = HEAD_DIM,
    seed: int = 0,
    num_splits: int | None = None,
    fp8_scales: tuple[float, float] | None = None,
) -> None:
    """Triton against torch on one random cache; ``fp8_scales`` makes it an fp8 cache.

    An fp8 cache holds K and V of unit size divided by ``(k_scale, v_scale)``; both backends
    get the scales, and the torch result is first checked against attention over the
    dequantized cache, so a scale applied twice or not at all fails either way.
    """
    batch = scattered_batch(seq_lens, query_lens, block_size, seed, device)
    meta = batch.meta
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    cache_shape = (batch.num_blocks, block_size, NUM_KV_HEADS, head_dim)
    key_cache, value_cache = randn(*cache_shape), randn(*cache_shape)
    query = randn(meta.num_tokens, NUM_KV_HEADS * queries_per_kv, head_dim)
    scale = head_dim**-0.5
    k_scale, v_scale = fp8_scales or (1.0, 1.0)
    if fp8_scales:
        key_cache, value_cache = (
            quantize_fp8(key_cache, k_scale),
            quantize_fp8(value_cache, v_scale),
        )

    cache = LayerKVCache(key_cache, value_cache, k_scale, v_scale)
    torch_plan = TORCH.plan(meta)
    expected = TORCH.paged_attention(query, cache, torch_plan, scale)
    if fp8_scales:
        dequantized = LayerKVCache(
            *(
                (tensor.float() * s).to(dtype)
                for tensor, s in ((key_cache, k_scale), (value_cache, v_scale))
            )
        )
        reference = TORCH.paged_attention(query, dequantized, torch_plan, scale)
        torch.testing.assert_close(expected, reference, **ATTENTION_TOL[dtype])
    plan = dataclasses.replace(TRITON.plan(meta), num_splits=num_splits)
    actual = TRITON.paged_attention(query, cache, plan, scale)
    torch.testing.assert_close(actual, expected, **ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_ID)
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_mixed_prefill_and_decode(
    dtype: torch.dtype, queries_per_kv: int, block_size: int, device: torch.device
) -> None:
    bs = block_size
    # (query_len, seq_len): a 1-token context; decodes whose context ends on, just past and
    # well past a block boundary; a whole prompt ending on a boundary; prefill chunks after
    # cached context, one ending on a block boundary, one on the kernel's 64-key step, and
    # one longer than a query tile.
    sequences = [
        (1, 1),
        (3, 64),
        (1, bs),
        (1, bs + 1),
        (2 * bs, 2 * bs),
        (7, 3 * bs),
        (5, bs + 9),
        (1, 2 * bs + 3),
        (bs + 3, 2 * bs + 8),
    ]
    query_lens, seq_lens = zip(*sequences, strict=True)
    _check_attention(
        list(query_lens),
        list(seq_lens),
        dtype=dtype,
        queries_per_kv=queries_per_kv,
        block_size=block_size,
        device=device,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_ID)
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_decode_only(
    dtype: torch.dtype, queries_per_kv: int, block_size: int, device: torch.device
) -> None:
    # All queries of length 1 select the shortest query tile, a different kernel shape.
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 2 * block_size]
    _check_attention(
        [1] * len(seq_lens),
        seq_lens,
        dtype=dtype,
        queries_per_kv=queries_per_kv,
        block_size=block_size,
        device=device,
        seed=1,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_ID)
@pytest.mark.parametrize("queries_per_kv", [1, 8])
def test_paged_attention_split_context(
    dtype: torch.dtype, queries_per_kv: int, device: torch.device
) -> None:
    # Flash decoding: each context is cut into 3 stretches attended by separate programs and
    # combined after. Short contexts leave some stretches empty, and the 20-token prefill has
    # rows that see no key of its last stretch; both must drop out of the combination cleanly.
    _check_attention(
        [1, 1, 1, 20, 6],
        [1, 16, 40, 50, 45],
        dtype=dtype,
        queries_per_kv=queries_per_kv,
        block_size=16,
        device=device,
        seed=3,
        num_splits=3,
    )


@st.composite
def _ragged_batches(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    seq_lens = draw(st.lists(st.integers(1, 64), min_size=1, max_size=3))
    query_lens = [draw(st.sampled_from([1, 1, n, draw(st.integers(1, n))])) for n in seq_lens]
    return query_lens, seq_lens


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    batch=_ragged_batches(),
    queries_per_kv=st.sampled_from([1, 3, 8]),
    block_size=st.sampled_from([16, 32]),
)
def test_paged_attention_random_ragged_batches(
    batch: tuple[list[int], list[int]], queries_per_kv: int, block_size: int
) -> None:
    query_lens, seq_lens = batch
    _check_attention(
        query_lens,
        seq_lens,
        dtype=torch.float32,
        queries_per_kv=queries_per_kv,
        block_size=block_size,
        device=torch.device(DEVICE),
    )


@pytest.mark.parametrize("block_size", [1, 8, 24])
def test_paged_attention_small_and_odd_block_sizes(block_size: int, device: torch.device) -> None:
    # Keys are gathered across blocks, so any block size the engine accepts works.
    _check_attention(
        [1, 9, 1],
        [1, 30, 49],
        dtype=torch.float32,
        queries_per_kv=3,
        block_size=block_size,
        device=device,
        seed=4,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_ID)
def test_paged_attention_odd_head_dim_and_bf16(dtype: torch.dtype, device: torch.device) -> None:
    # head_dim 80 is padded to 128 inside the kernel; bf16 is the engine's usual dtype.
    _check_attention(
        [1, 20, 1],
        [17, 20, 40],
        dtype=dtype,
        queries_per_kv=3,
        block_size=16,
        device=device,
        head_dim=80,
        seed=2,
    )


# Scales far from 1, as calibrated scales of a layer with small or large activations would be.
FP8_SCALES = (0.02, 3.5)
# (query_lens, seq_lens, queries_per_kv, num_splits): a whole prompt, a prefill chunk after
# cached context, and decodes on and past a block end, without and with GQA; then decodes only
# (the shortest query tile) over contexts cut into 3 stretches.
FP8_BATCHES = {
    "prefill-decode": ([1, 16, 6, 1], [1, 16, 37, 33], 1, None),
    "prefill-decode-gqa4": ([1, 16, 6, 1], [1, 16, 37, 33], 4, None),
    "decode-gqa3-split3": ([1, 1, 1], [5, 16, 41], 3, 3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_ID)
@pytest.mark.parametrize("batch", FP8_BATCHES.values(), ids=FP8_BATCHES.keys())
def test_paged_attention_fp8_cache(
    dtype: torch.dtype, batch: tuple[list[int], list[int], int, int | None], device: torch.device
) -> None:
    query_lens, seq_lens, queries_per_kv, num_splits = batch
    _check_attention(
        query_lens,
        seq_lens,
        dtype=dtype,
        queries_per_kv=queries_per_kv,
        block_size=16,
        device=device,
        seed=6,
        num_splits=num_splits,
        fp8_scales=FP8_SCALES,
    )


@pytest.mark.slow
def test_engine_with_fp8_cache_on_triton_matches_the_torch_backend(device: torch.device) -> None:
    # The real model end to end (a prefill and a decode through every layer's kernels), in
    # float32 so that the two backends differ by rounding order only. Measured on CPU: the
    # log-probabilities agree to 5e-6; the bound leaves room for an fp8 rounding flip.
    from llmpool.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, logprobs=2, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model=None,
            device=device.type,
            dtype="float32",
            kv_cache_dtype="fp8",
            attention_backend=backend,
            max_model_len=64,
            num_kv_blocks=8,
        )
        assert llm.engine.kv_caches[0][0].dtype == FP8_DTYPE
        outputs[backend] = llm.generate("The capital of France is", params)[0].outputs[0]
    expected, actual = outputs["torch"], outputs["triton"]
    assert actual.token_ids == expected.token_ids
    assert expected.logprobs is not None and actual.logprobs is not None
    for token, expected_top, actual_top in zip(
        expected.token_ids, expected.logprobs, actual.logprobs, strict=True
    ):
        assert actual_top[token] == pytest.approx(expected_top[token], abs=2e-2)


def test_fp8_cache_on_triton_needs_compute_capability_8_9(device: torch.device) -> None:
    check_kv_cache_dtype(TRITON, FP8_DTYPE, device)  # the CPU interpreter and Hopper have e4m3
    check_fp8_capability((8, 9), "NVIDIA L4")
    with pytest.raises(ValueError, match=r"8\.9 or newer .*A100-SXM4-80GB has 8\.0"):
        check_fp8_capability((8, 0), "NVIDIA A100-SXM4-80GB")


@pytest.mark.parametrize(("capability", "expected"), [((8, 0), "torch"), ((9, 0), "triton")])
def test_auto_runs_an_fp8_cache_on_torch_where_triton_lacks_e4m3(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: str
) -> None:
    """kvCacheDtype fp8 is accepted for any GPU pool, so the engine must start on any GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda")
    kernels = KernelCapabilities()
    assert select_backend(cuda, "auto", FP8_DTYPE, kernels=kernels).name == expected
    assert select_backend(cuda, "auto", torch.bfloat16, kernels=kernels).name == "triton"


def test_scales_are_refused_for_a_cache_in_the_model_dtype(device: torch.device) -> None:
    cache = torch.zeros(1, 16, NUM_KV_HEADS, HEAD_DIM, device=device)
    with pytest.raises(ValueError, match="fp8 cache only"):
        LayerKVCache(cache, cache, 0.5, 1.0)


def _write_with_both_backends(
    qkv: torch.Tensor,
    slots: torch.Tensor,
    cache_shape: tuple[int, ...],
    cache_dtype: torch.dtype | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (K, V) caches that the torch and then the Triton write_kv fill from ``qkv``'s K and V."""
    key, value = qkv[:, NUM_KV_HEADS : 2 * NUM_KV_HEADS], qkv[:, 2 * NUM_KV_HEADS :]
    written = []
    for backend in (TORCH, TRITON):
        key_cache, value_cache = (
            torch.zeros(cache_shape, dtype=cache_dtype or qkv.dtype, device=qkv.device)
            for _ in range(2)
        )
        backend.write_kv(key, value, LayerKVCache(key_cache, value_cache, *scales), slots)
        written.append((key_cache, value_cache))
    return written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_ID)
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_matches_reference(
    dtype: torch.dtype, block_size: int, device: torch.device
) -> None:
    num_blocks, num_tokens = 4, 2 * block_size + 3
    generator = torch.Generator().manual_seed(3)
    # Slots include the first and last offset of a block, and the very last slot of the cache.
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[:3] = torch.tensor([block_size - 1, block_size, num_blocks * block_size - 1])
    slots = slots.to(device)
    # K and V as views into a fused QKV projection output, as the model produces them.
    qkv = torch.randn(num_tokens, 3 * NUM_KV_HEADS, HEAD_DIM, generator=generator)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    expected, actual = _write_with_both_backends(qkv.to(dtype=dtype, device=device), slots, shape)
    for expected_cache, actual_cache in zip(expected, actual, strict=True):
        assert torch.equal(actual_cache, expected_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_ID)
def test_write_kv_fp8_matches_reference_bytes(dtype: torch.dtype, device: torch.device) -> None:
    block_size, num_blocks, num_tokens = 16, 3, 21
    generator = torch.Generator().manual_seed(8)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(device)
    # Magnitudes from 1e-4 (e4m3 subnormals and zeros once divided by the scale) to 1e3
    # (saturated at ±448), as views into a fused QKV output.
    magnitude = torch.logspace(-4, 3, num_tokens)[:, None, None]
    qkv = torch.randn(num_tokens, 3 * NUM_KV_HEADS, HEAD_DIM, generator=generator) * magnitude
    # k_scale 0.5 makes exact ties of e4m3 (1.0625 and 1.1875 round to even: 1.0 and 1.25),
    # negative zero, and a value that rounds to negative zero.
    qkv[0, NUM_KV_HEADS, :4] = torch.tensor([0.53125, 0.59375, -0.0, -1e-4])
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    expected, actual = _write_with_both_backends(
        qkv.to(dtype=dtype, device=device), slots, shape, FP8_DTYPE, (0.5, 0.037)
    )
    for expected_cache, actual_cache in zip(expected, actual, strict=True):
        assert torch.equal(actual_cache.view(torch.uint8), expected_cache.view(torch.uint8))
    stored = expected[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[int(slots[0]), 0, :4]
    assert stored.float().tolist() == [1.0, 1.25, 0.0, 0.0]
    assert stored.view(torch.uint8)[2:].tolist() == [0x80, 0x80]  # -0.0 in e4m3


def test_write_kv_skips_negative_slots(device: torch.device) -> None:
    key = torch.ones(2, NUM_KV_HEADS, HEAD_DIM, device=device)
    key_cache = torch.zeros(2, 16, NUM_KV_HEADS, HEAD_DIM, device=device)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([-1, 17], device=device)
    TRITON.write_kv(key, key, LayerKVCache(key_cache, value_cache), slots)
    assert key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[17].eq(1).all()
    assert key_cache.sum() == NUM_KV_HEADS * HEAD_DIM


# One or two units in the last place of fp16/bf16 (bf16: the interpreter rounds fp32 to bf16
# toward zero where GPUs round to nearest, which costs up to one more unit).
NORM_TOL = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
    ids=["fp32", "fp16", "bf16", "bf16-fp32-weight"],
)
def test_rms_norm_and_fused_add(
    dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device
) -> None:
    generator = torch.Generator().manual_seed(4)
    hidden = 96  # not a power of two: the kernel masks the tail of its block
    x = torch.randn(2, 5, hidden, generator=generator).to(dtype=dtype, device=device)
    residual = torch.randn(2, 5, hidden, generator=generator).to(dtype=dtype, device=device)
    weight = (1 + torch.randn(hidden, generator=generator)).to(dtype=weight_dtype, device=device)
    eps = 1e-6

    expected = TORCH.rms_norm(x, weight, eps)
    actual = TRITON.rms_norm(x, weight, eps)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **NORM_TOL[dtype])

    expected_out, expected_residual = TORCH.fused_add_rms_norm(x, residual, weight, eps)
    actual_out, actual_residual = TRITON.fused_add_rms_norm(x, residual, weight, eps)
    # x + residual is rounded once, as in torch: exact, but for the interpreter's bf16 rounding.
    exact = {"atol": 0.0, "rtol": 0.0}
    residual_tol = NORM_TOL[dtype] if dtype == torch.bfloat16 else exact
    torch.testing.assert_close(actual_residual, expected_residual, **residual_tol)
    assert actual_out.dtype == expected_out.dtype
    torch.testing.assert_close(actual_out, expected_out, **NORM_TOL[dtype])


def _cos_sin_cache(max_positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_ID)
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
def test_rotary_embedding(dtype: torch.dtype, queries_per_kv: int, device: torch.device) -> None:
    generator = torch.Generator().manual_seed(5)
    num_tokens, num_heads = 7, NUM_KV_HEADS * queries_per_kv
    cache = _cos_sin_cache(128, HEAD_DIM).to(device)
    positions = torch.tensor([0, 1, 15, 16, 17, 64, 127], device=device)
    # q and k as views into one fused QKV output: strided along tokens.
    qkv = torch.randn(num_tokens, num_heads + 2 * NUM_KV_HEADS, HEAD_DIM, generator=generator)
    qkv = qkv.to(dtype=dtype, device=device)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + NUM_KV_HEADS]
    before = qkv.clone()

    expected_q, expected_k = TORCH.rotary_embedding(positions, query, key, cache)
    actual_q, actual_k = TRITON.rotary_embedding(positions, query, key, cache)
    # fp16/bf16: the reference rounds each product to the dtype, the kernel only the result.
    tol = NORM_TOL[dtype] if dtype != torch.float32 else {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(actual_q, expected_q, **tol)
    torch.testing.assert_close(actual_k, expected_k, **tol)
    assert torch.equal(qkv, before), "rotary_embedding must not modify its inputs"


LORA_TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-2, "rtol": 2e-2},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_ID)
@pytest.mark.parametrize("max_rank", [8, 16])
def test_lora_add_matches_reference(
    dtype: torch.dtype, max_rank: int, device: torch.device, lora_case: Callable[..., Any]
) -> None:
    # Groups of 1, 17 and 5 rows on slots 2, 0 and 3 among 7 base-model rows; 48 input features
    # (not a multiple of the kernel's K step); parts of 32, 16 and 16 columns.
    case = lora_case(max_rank, dtype, device)
    expected = case.out.clone()
    TORCH.lora_add(expected, case.x, case.weights, TORCH.lora_plan(case.batch, case.scaling))
    plan = TRITON.lora_plan(case.batch, case.scaling)
    # Rows per program from the longest group (one tile for 17 rows), then 16 (two tiles).
    for block_m in (plan.block_m, 16):
        actual = case.out.clone()
        TRITON.lora_add(actual, case.x, case.weights, dataclasses.replace(plan, block_m=block_m))
        torch.testing.assert_close(actual, expected, **LORA_TOL[dtype])
        base_rows = [row for row, slot in enumerate(case.row_slots) if slot < 0]
        assert torch.equal(actual[base_rows], case.out[base_rows])


def test_engine_with_adapters_on_triton_matches_the_torch_backend(
    device: torch.device, save_small_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    # The kernel as the model calls it: every projection of every layer, on the real stacks
    # (strided views, fused parts); a prefill and a decode of base-model and two adapters' rows
    # in one batch, float32, on a 2-layer random Llama (the built-in model's 30 layers take
    # minutes under the interpreter). The adapters must move the log-probabilities.
    from transformers import LlamaConfig

    from llmpool.engine import LLM, SamplingParams
    from llmpool.engine.lora import LoRARequest
    from llmpool.engine.lora.adapter import random_adapter
    from llmpool.engine.models.llama import LlamaShape

    config = small_config(LlamaConfig, intermediate_size=160)
    model = save_small_checkpoint(config, tmp_path / "model")
    shape = LlamaShape.from_hf_config(config)
    modules = [["q_proj", "v_proj", "down_proj"], ["k_proj", "o_proj", "gate_proj", "up_proj"]]
    adapters: list[LoRARequest | None] = [None]
    for index, (rank, names) in enumerate(zip([8, 16], modules, strict=True)):
        folder = tmp_path / f"adapter-{index}"
        random_adapter(folder, shape, names, rank=rank, alpha=2 * rank, seed=index, std=0.2)
        adapters.append(LoRARequest(f"adapter-{index}", index + 1, str(folder)))
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=2, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(model),
            device=device.type,
            dtype="float32",
            attention_backend=backend,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
            max_model_len=64,
            num_kv_blocks=8,
        )
        prompts = ["The capital of France is"] * len(adapters)
        generated = llm.generate(prompts, params, lora_request=adapters)
        outputs[backend] = [output.outputs[0] for output in generated]
    first_logprobs = []
    for expected, actual in zip(outputs["torch"], outputs["triton"], strict=True):
        assert actual.token_ids == expected.token_ids
        assert expected.logprobs is not None and actual.logprobs is not None
        for token, expected_top, actual_top in zip(
            expected.token_ids, expected.logprobs, actual.logprobs, strict=True
        ):
            assert actual_top[token] == pytest.approx(expected_top[token], abs=1e-4)
        first_logprobs.append(expected.logprobs[0][expected.token_ids[0]])
    assert len({round(logprob, 3) for logprob in first_logprobs}) == len(adapters)
