"""int4 and int8 weight-only layers against their dequantized reference matmuls (no model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from llmpool.engine.kernels import vnni_gemm
from llmpool.engine.kernels.capabilities import probe_kernels
from llmpool.engine.models import int4
from llmpool.engine.models.int4 import (
    INT4_GROUP_SIZE,
    Int4Linear,
    dequantize_int4,
    pack_int4,
    quantize_groups_int4,
    unpack_int4_transposed,
)
from llmpool.engine.models.quantization import (
    INT8_KERNEL_MAX_ROWS,
    INT8_VNNI_MAX_ROWS,
    Int8Linear,
    int8_split_matmul,
    quantize_rows_int8,
)
from tests.conftest import needs_cpu

# SmolLM2's layer shapes (out, in): qkv, o, gate_up, down.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
DTYPES = [torch.float32, torch.bfloat16]
# Rows on each side of INT8_KERNEL_MAX_ROWS and INT8_VNNI_MAX_ROWS: decode (a fused kernel) and
# prefill (split int8).
ROWS = [1, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, INT8_VNNI_MAX_ROWS + 1, 64]
needs_vnni_kernels = needs_cpu("avx512_vnni", "avx512vbmi")
KERNELS = probe_kernels(torch.device("cpu"))
BLOCK = KERNELS.int4_pack_block


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the largest expected value."""
    return float((got.float() - expected).abs().max() / expected.abs().max())


def test_packing_round_trips_and_matches_torchs_converter() -> None:
    codes = torch.randint(0, 16, (192, 256), dtype=torch.uint8)
    packed = pack_int4(codes, BLOCK)
    assert packed.shape == (192, 128) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4_transposed(packed, BLOCK), codes.t())
    if hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        converted = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        assert torch.equal(packed, converted)


def test_int4_groups_round_trip_within_half_a_step() -> None:
    weight = torch.randn(128, 4 * INT4_GROUP_SIZE) * torch.linspace(0.01, 3, 128)[:, None]
    codes, scales_and_zeros = quantize_groups_int4(weight)
    assert scales_and_zeros.shape == (4, 128, 2) and scales_and_zeros.dtype == torch.bfloat16
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    step = scales_and_zeros[..., 0].float().t().repeat_interleave(INT4_GROUP_SIZE, dim=1)
    zero = scales_and_zeros[..., 1].float().t().repeat_interleave(INT4_GROUP_SIZE, dim=1)
    expected = (codes.float() - 8) * step + zero
    dequantized = dequantize_int4(pack_int4(codes, BLOCK), scales_and_zeros, BLOCK)
    torch.testing.assert_close(dequantized, expected, rtol=1e-6, atol=1e-6)
    # Within half a step of the weight, plus the bfloat16 rounding of the zero.
    assert bool(((dequantized - weight).abs() <= step / 2 + zero.abs() * 2**-8 + 1e-6).all())


def test_int4_refuses_shapes_the_layout_cannot_hold() -> None:
    with pytest.raises(ValueError, match="int4 needs output features divisible by 64"):
        Int4Linear.from_float(torch.randn(96, 128), None, KERNELS)
    with pytest.raises(ValueError, match=f"input features by {INT4_GROUP_SIZE}"):
        Int4Linear.from_float(torch.randn(64, INT4_GROUP_SIZE + 16), None, KERNELS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int4_layer_matches_its_dequantized_weight(
    out_features: int, in_features: int, rows: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    layer = Int4Linear.from_float(
        torch.randn(out_features, in_features), torch.randn(out_features), KERNELS
    )
    layer = layer.to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    # The CPU kernel computes in bfloat16 (float32 accumulation): the reference rounds x alike.
    expected = x.bfloat16().float() @ layer.dequantize().T + layer.bias.float()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert relative_error(got, expected) < 2**-7


def test_int4_reference_path_is_the_kernels_function() -> None:
    """What runs where no kernel does (CUDA, older torch): the dequantized float matmul."""
    torch.manual_seed(0)
    layer = Int4Linear.from_float(torch.randn(192, 128), None, KERNELS)
    x = torch.randn(5, 128)
    kernel = layer(x)
    layer.use_kernels(replace(KERNELS, torch_int4=False, vnni_gemm=False))
    reference = layer(x)
    torch.testing.assert_close(reference, x @ layer.dequantize().T)
    assert relative_error(kernel, reference) < 2**-7


def test_int4_scales_keep_their_bits_through_a_dtype_cast() -> None:
    layer = Int4Linear.from_float(torch.randn(64, 128), None, KERNELS)
    before = layer.scales_and_zeros.clone()
    layer.to(torch.float32)
    assert layer.scales_and_zeros.dtype == torch.bfloat16
    assert torch.equal(layer.scales_and_zeros, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int8_layer_matches_its_dequantized_weight(
    out_features: int, in_features: int, rows: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    quantized, scale = quantize_rows_int8(weight)
    layer = Int8Linear.from_float(weight, None, KERNELS).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    dequantized = quantized.float() * layer.scale.float()[:, None]
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torchs_kernel = rows <= INT8_KERNEL_MAX_ROWS and not KERNELS.vnni_gemm
    if torchs_kernel:  # torch's fused kernel, in bfloat16
        expected = x.bfloat16().float() @ dequantized.T
        assert relative_error(got, expected) < 2**-7
    else:  # split int8 activations (the VNNI kernel's too): 15 bits per row, then the output's dtype
        expected = x.float() @ dequantized.T
        output_rounding = 2**-7 if dtype == torch.bfloat16 else 1e-4
        assert relative_error(got, expected) < output_rounding


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """The rows of each call of ``vnni_gemm.<name>`` from now on (the kernel still runs)."""
    calls: list[int] = []
    kernel = getattr(vnni_gemm, name)

    def counted(x: torch.Tensor, *operands: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, *operands)

    monkeypatch.setattr(vnni_gemm, name, counted)
    return calls


def assert_takes_strided_and_empty_rows(
    kernel: Callable[..., torch.Tensor],
    operands: tuple[torch.Tensor, ...],
    inputs: int,
    outputs: int,
) -> None:
    """Strided rows give what their contiguous copy gives; no rows give an empty result."""
    strided = torch.randn(2, 2 * inputs)[:, ::2]
    assert torch.equal(kernel(strided, *operands), kernel(strided.contiguous(), *operands))
    assert kernel(strided[:0], *operands).shape == (0, outputs)


def assert_split_matmuls_numbers(got: torch.Tensor, x: torch.Tensor, layer: Int8Linear) -> None:
    """``got`` is ``int8_split_matmul``'s result up to the rounding of its last float32 steps."""
    expected = int8_split_matmul(x, layer.weight, layer.scale)
    tolerance = 1e-6 * float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=tolerance)


@needs_vnni_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 40])
@pytest.mark.parametrize(("out_features", "in_features"), [*SHAPES, (7, 100), (5, 64), (3, 1)])
def test_the_int8_kernel_computes_the_split_matmuls_numbers(
    out_features: int, in_features: int, rows: int
) -> None:
    """Every tile remainder (4 outputs, 2 rows), K tails of 64 and a tail alone."""
    torch.manual_seed(0)
    layer = Int8Linear.from_float(torch.randn(out_features, in_features), None, KERNELS)
    x = torch.randn(rows, in_features) * torch.logspace(-3, 2, rows)[:, None]
    got = vnni_gemm.int8_linear(x, layer.weight, layer.weight_sums, layer.scale)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert_split_matmuls_numbers(got, x, layer)


@needs_vnni_kernels
def test_the_int8_kernel_takes_bfloat16_and_strided_rows_and_refuses_other_operands() -> None:
    torch.manual_seed(0)
    layer = Int8Linear.from_float(torch.randn(960, 576), None, KERNELS)
    operands = (layer.weight, layer.weight_sums, layer.scale)
    x = torch.randn(6, 576).bfloat16()
    assert_split_matmuls_numbers(vnni_gemm.int8_linear(x, *operands), x.float(), layer)
    assert_takes_strided_and_empty_rows(vnni_gemm.int8_linear, operands, 576, 960)
    with pytest.raises(ValueError, match="int8 weights"):
        vnni_gemm.int8_linear(x, layer.weight.float(), *operands[1:])
    with pytest.raises(ValueError, match="rows of shape"):
        vnni_gemm.int8_linear(x[:, :-1], *operands)
    with pytest.raises(ValueError, match="for 960 outputs"):
        vnni_gemm.int8_linear(x, layer.weight, layer.weight_sums[:-1], layer.scale)


@needs_vnni_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_layers_run_the_vnni_kernel_up_to_its_rows(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Up to INT8_VNNI_MAX_ROWS rows an int8 layer calls the kernel; above, the split matmul
    (the same numbers, which is why the calls are counted)."""
    torch.manual_seed(0)
    layer = Int8Linear.from_float(torch.randn(576, 576), None, KERNELS).to(dtype)
    calls = count_kernel_calls(monkeypatch, "int8_linear")
    for rows in (1, INT8_VNNI_MAX_ROWS, INT8_VNNI_MAX_ROWS + 1):
        x = torch.randn(rows, 576).to(dtype)
        got = layer(x)
        assert got.dtype == dtype
        expected = int8_split_matmul(x, layer.weight, layer.scale).to(dtype)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert calls == [1, INT8_VNNI_MAX_ROWS]


@needs_vnni_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13])
@pytest.mark.parametrize(("out_features", "in_features"), [*SHAPES, (128, 64), (64, 32)])
def test_the_int4_kernel_is_the_dequantized_product_closer_than_torchs(
    out_features: int, in_features: int, rows: int
) -> None:
    """Rows split into 15 bits against torch's bfloat16 rows: the kernel is within 2e-4 of the
    float32 product of the dequantized weight (~50x closer than torch's kernel here)."""
    torch.manual_seed(0)
    layer = Int4Linear.from_float(torch.randn(out_features, in_features), None, KERNELS)
    x = torch.randn(rows, in_features) * torch.logspace(-2, 2, rows)[:, None]
    expected = x @ layer.dequantize().T
    got = vnni_gemm.int4_linear(x, layer.weight, layer.scales_and_zeros_bits)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert relative_error(got, expected) < 2e-4
    if int4.torch_has_int4_cpu_kernel():
        torchs = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), layer.weight, INT4_GROUP_SIZE, layer.scales_and_zeros
        )
        assert relative_error(got, expected) < relative_error(torchs, expected)


@needs_vnni_kernels
def test_the_int4_kernels_rows_do_not_depend_on_each_other() -> None:
    """Rows share each unpacking of the codes (up to 6 at a time): every row's result is the one
    it gets alone, bit for bit, whichever tile and place in it the row has."""
    torch.manual_seed(0)
    layer = Int4Linear.from_float(torch.randn(192, 576), None, KERNELS)
    operands = (layer.weight, layer.scales_and_zeros_bits)
    x = torch.randn(13, 576) * torch.logspace(-3, 3, 13)[:, None]
    together = vnni_gemm.int4_linear(x, *operands)
    for row in range(13):
        assert torch.equal(together[row], vnni_gemm.int4_linear(x[row : row + 1], *operands)[0])


@needs_vnni_kernels
@pytest.mark.parametrize("rows", [1, 5, 6, 16, 17, 32, 33, 64, 127, 511])
@pytest.mark.parametrize(("out_features", "in_features"), [(192, 128), (128, 1536)])
def test_bfloat16_int4_rows_multiply_the_dequantized_weight_on_amx_tiles(
    out_features: int, in_features: int, rows: int
) -> None:
    """Where the build has AMX tiles, bfloat16 rows from INT4_AMX_MIN_ROWS on get the float32
    product of the rows and the weight as ``int4_dequantize`` rounds it, up to summation order
    (both halves of each block of 64 outputs; one or two tiles of 16 rows a pass, the last one
    part-filled); fewer rows get the integer kernel's result for the same values, bit for bit, and
    so does every row count in the build without tiles."""
    torch.manual_seed(0)
    layer = Int4Linear.from_float(torch.randn(out_features, in_features), None, KERNELS)
    operands = (layer.weight, layer.scales_and_zeros_bits)
    x = torch.randn(rows, in_features).bfloat16()
    got = vnni_gemm.int4_linear(x, *operands)
    integer = vnni_gemm.int4_linear(x.float(), *operands)
    if vnni_gemm.int4_tiles() and rows >= vnni_gemm.INT4_AMX_MIN_ROWS:
        expected = x.float() @ vnni_gemm.int4_dequantize(*operands).float()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
        assert relative_error(got, x.float() @ layer.dequantize().T) < 2**-7
    else:
        assert torch.equal(got, integer)
    library = vnni_gemm.integer_build()
    if library is not None:
        assert torch.equal(vnni_gemm.int4_linear(x, *operands, library=library), integer)


@needs_vnni_kernels
@pytest.mark.slow
def test_a_compiled_int4_layer_dequantizes_large_bfloat16_batches_inside_its_graph() -> None:
    """The dequantizer is an opaque op (``llmpool::int4_dequantize``) that a compiled forward
    calls without breaking its graph, to the eager forward's result."""
    torch.manual_seed(0)
    kernels = replace(KERNELS, native_bf16=True)
    layer = Int4Linear.from_float(torch.randn(192, 128), None, kernels).bfloat16()
    x = torch.randn(kernels.int4_dequantized_min_rows, 128).bfloat16()
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


@needs_vnni_kernels
@pytest.mark.parametrize(("out_features", "in_features"), [*SHAPES, (64, 32)])
def test_the_int4_dequantizer_is_torchs_dequantized_weight_in_bfloat16(
    out_features: int, in_features: int
) -> None:
    torch.manual_seed(0)
    layer = Int4Linear.from_float(torch.randn(out_features, in_features) * 4, None, KERNELS)
    got = vnni_gemm.int4_dequantize(layer.weight, layer.scales_and_zeros_bits)
    assert got.is_contiguous()
    assert torch.equal(got, layer.dequantize().T.bfloat16())
    with pytest.raises(ValueError, match="int4_dequantize takes uint8 codes"):
        vnni_gemm.int4_dequantize(layer.weight.to(torch.int8), layer.scales_and_zeros_bits)
    with pytest.raises(ValueError, match="groups of 32"):
        vnni_gemm.int4_dequantize(layer.weight[:32], layer.scales_and_zeros_bits)


@needs_vnni_kernels
def test_the_int4_kernel_takes_bfloat16_and_strided_rows_and_refuses_other_operands() -> None:
    torch.manual_seed(0)
    layer = Int4Linear.from_float(torch.randn(192, 128), None, KERNELS)
    operands = (layer.weight, layer.scales_and_zeros_bits)
    x = torch.randn(2, 128).bfloat16()
    expected = x.float() @ layer.dequantize().T
    assert relative_error(vnni_gemm.int4_linear(x, *operands), expected) < 2e-4
    assert_takes_strided_and_empty_rows(vnni_gemm.int4_linear, operands, 128, 192)
    with pytest.raises(ValueError, match="uint8 codes"):
        vnni_gemm.int4_linear(x, layer.weight.to(torch.int8), layer.scales_and_zeros_bits)
    with pytest.raises(ValueError, match="rows of shape"):
        vnni_gemm.int4_linear(x[:, :-1], *operands)
    with pytest.raises(ValueError, match="groups of 32"):
        vnni_gemm.int4_linear(x, layer.weight[:64], layer.scales_and_zeros_bits)


@needs_vnni_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_layers_run_the_vnni_kernel_at_every_row_count(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    kernels = replace(KERNELS, native_bf16=False)
    layer = Int4Linear.from_float(torch.randn(192, 128), None, kernels).to(dtype)
    calls = count_kernel_calls(monkeypatch, "int4_linear")
    row_counts = [1, 2, 7, 64, 300]
    for rows in row_counts:
        x = torch.randn(rows, 128).to(dtype)
        got = layer(x)
        assert got.dtype == dtype and got.shape == (rows, 192)
        assert relative_error(got, x.float() @ layer.dequantize().T) < 2**-7
    assert calls == row_counts


@needs_vnni_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_bfloat16_int4_batches_dequantize_where_the_cpu_multiplies_bfloat16(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """From the capabilities' ``int4_dequantized_min_rows`` bfloat16 rows on the layer multiplies
    its weight dequantized to bfloat16; fewer rows, float32 rows, or a CPU without native bfloat16
    products run the kernel."""
    torch.manual_seed(0)
    kernels = replace(KERNELS, native_bf16=True, int4_dequantized_min_rows=8)
    layer = Int4Linear.from_float(torch.randn(192, 128), None, kernels).to(dtype)
    calls = count_kernel_calls(monkeypatch, "int4_linear")
    for rows in (7, 8, 30):
        x = torch.randn(rows, 128).to(dtype)
        got = layer(x)
        assert got.dtype == dtype
        assert relative_error(got, x.float() @ layer.dequantize().T) < 2**-7
    kernel_rows = [7] if dtype == torch.bfloat16 else [7, 8, 30]
    assert calls == kernel_rows
    layer.use_kernels(replace(KERNELS, native_bf16=False))
    layer(torch.randn(30, 128).to(dtype))
    assert calls == [*kernel_rows, 30]


def test_int4_batches_dequantize_later_where_their_rows_run_on_amx_tiles() -> None:
    """The probe sets the row count from which bfloat16 int4 batches dequantize by whether this
    CPU's build multiplies them on tiles, and the C decoder's int4 steps stop just below it."""
    tiles = vnni_gemm.KERNEL.available and vnni_gemm.int4_tiles()
    expected = int4.INT4_TILES_DEQUANTIZED_MIN_ROWS if tiles else int4.INT4_DEQUANTIZED_MIN_ROWS
    assert KERNELS.int4_dequantized_min_rows == expected
    assert int4.INT4_DEQUANTIZED_MIN_ROWS < int4.INT4_TILES_DEQUANTIZED_MIN_ROWS


def test_switched_off_quantized_layers_run_torchs_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers given capabilities without the VNNI kernels (as the benchmark measures torch's
    kernels): no call reaches ours."""

    def refuse(*operands: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a kernel was called while switched off")

    monkeypatch.setattr(vnni_gemm, "int4_linear", refuse)
    monkeypatch.setattr(vnni_gemm, "int8_linear", refuse)
    torchs_only = replace(KERNELS, vnni_gemm=False)
    x = torch.randn(1, 128)
    Int4Linear.from_float(torch.randn(64, 128), None, torchs_only)(x)
    Int8Linear.from_float(torch.randn(64, 128), None, torchs_only)(x)
