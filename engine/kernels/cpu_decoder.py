"""A decode step's decoder layers in one C call on CPU: ``cpu_decoder.c``, and the model it runs.

Layer by layer, a step calls ~14 kernels a layer through torch, ctypes and ``nn.Module``; at one
decoding request on a 2-core Zen 4 EPYC that is ~4 of an ~11.5 ms bfloat16 step of SmolLM2, the
GEMMs ~7. :class:`CpuDecoder` runs the same kernels (the projections' C GEMM: this CPU's few-row
dense one or ``vnni_gemm``'s int8 or int4 one; ``cpu_layer_ops``' norms, rotary and
SiLU-and-mul; ``cpu_decode``'s attention) from one C call over every layer, so its result is the
layer-by-layer one bit for bit. The model hands it the
steps it can run (:meth:`CpuDecoder.takes`): decodes only, as many as that GEMM is chosen for, no
adapter rows; any other step runs layer by layer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from llmpool.engine.kernels import avx2_gemm, bf16_gemm, cpu_decode, cpu_layer_ops, vnni_gemm
from llmpool.engine.kernels.c_loader import CKernel
from llmpool.engine.models import int4
from llmpool.engine.models.linear import Linear

if TYPE_CHECKING:
    from llmpool.engine.attention import Backend
    from llmpool.engine.attention.metadata import AttentionMetadata
    from llmpool.engine.kernels.capabilities import KernelCapabilities
    from llmpool.engine.models.llama import LlamaForCausalLM

SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_pointer, _size = ctypes.c_void_p, ctypes.c_int64
KERNEL = CKernel(
    "cpu_decoder.c",
    {f"decode_layers_{suffix}": [_pointer] * 10 + [_size] * 2 for suffix in SUFFIXES.values()},
)
DENSE, INT8, INT4 = 0, 1, 2  # model_t.weights


class Model(ctypes.Structure):
    """``model_t``: the kernels (addresses) and sizes of one model."""

    _fields_ = [
        *((name, _pointer) for name in ("gemm", "int8", "int4", "norm", "rotary", "silu_and_mul",
                                        "decode", "cos_sin", "final_norm")),
        *((name, _size) for name in ("weights", "layers", "hidden", "intermediate", "heads",
                                     "kv_heads", "head_dim", "block_size")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]  # fmt: skip


class Projection(ctypes.Structure):
    """``proj_t``: one projection's operands, by address."""

    _fields_ = [(name, _pointer) for name in ("weight", "aux", "scales")]


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Layer(ctypes.Structure):
    """``layer_t``: one layer's weights and KV cache, by address."""

    _fields_ = [
        *((name, _pointer) for name in ("input_norm", "post_norm", "qkv_bias")),
        *((name, Projection) for name in PROJECTIONS),
        *((name, _pointer) for name in ("key_cache", "value_cache")),
    ]


def _address(library: ctypes.CDLL, symbol: str) -> int:
    address = ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value
    assert address is not None
    return address


@dataclass(frozen=True)
class Projections:
    """How a model's projections run in the C decoder: ``weights`` (``DENSE``, ``INT8`` or
    ``INT4``), the address of the kernel they run in, and up to how many rows they run there."""

    weights: int
    kernel: int
    max_rows: int


# ``linear.BFLOAT16_KERNELS``' kernels as C functions: the library and its symbol.
BFLOAT16_SYMBOLS: dict[str, tuple[CKernel, str]] = {
    "bf16_gemm": (bf16_gemm.KERNEL, "bf16_linear"),
    "bf16_gemm_widened": (bf16_gemm.KERNEL, "bf16_linear_widened"),
    "avx2_gemm": (avx2_gemm.KERNEL, "bf16_linear"),
}


def projections(
    modules: list[nn.Module], dtype: torch.dtype, kernels: KernelCapabilities
) -> Projections | None:
    """Where ``modules`` (every projection of a ``dtype`` model) run their decode rows as the
    layers would: all dense in the C GEMM ``kernels.gemm`` chose for the dtype, or all int8 or
    all int4 in ``vnni_gemm``; None where some run in torch."""
    from llmpool.engine.models.quantization import INT8_VNNI_MAX_ROWS, Int8Linear  # a cycle

    gemm = kernels.gemm
    if all(type(m) is Linear and m.weight.dtype == dtype for m in modules):
        if dtype == torch.bfloat16 and gemm.bfloat16_kernel_max_rows is not None:
            kernel, symbol = BFLOAT16_SYMBOLS[gemm.bfloat16_kernel]
            address = _address(kernel.built(), symbol)
            return Projections(DENSE, address, gemm.bfloat16_kernel_max_rows)
        if dtype == torch.float32 and gemm.float32_kernel_max_rows is not None:
            address = _address(avx2_gemm.KERNEL.built(), "f32_linear")
            return Projections(DENSE, address, gemm.float32_kernel_max_rows)
        return None
    if all(isinstance(m, Int8Linear) and m.vnni for m in modules):
        address = _address(vnni_gemm.KERNEL.built(), "int8_linear")
        return Projections(INT8, address, INT8_VNNI_MAX_ROWS)
    if all(isinstance(m, int4.Int4Linear) and m.vnni for m in modules):
        symbol = "int4_linear_bf16" if dtype == torch.bfloat16 else "int4_linear"
        address = _address(vnni_gemm.KERNEL.built(), symbol)
        # Larger bfloat16 batches may dequantize instead (Int4Linear.dequantized_min_rows).
        return Projections(INT4, address, min(m.dequantized_min_rows for m in modules) - 1)
    return None


def _operands(module: nn.Module) -> list[torch.Tensor | None]:
    """A projection's tensors in ``proj_t``'s order."""
    if isinstance(module, int4.Int4Linear):
        return [module.weight, module.scales_and_zeros_bits, None]
    if isinstance(module, Linear):
        return [module.weight, None, None]
    return [module.weight, module.weight_sums, module.float_scale]  # Int8Linear


class CpuDecoder:
    """The decoder layers and final norm of ``model`` for decode steps, in ``cpu_decoder.c``.

    It holds the weights' addresses: built for the model as it runs (loaded, cast, moved into
    huge pages) by ``engine_builder.load_model``, and rebuilt by
    ``LlamaForCausalLM.use_kernels``. The KV caches' addresses are read again whenever a forward
    passes another list of caches."""

    def __init__(self, model: LlamaForCausalLM, runs: Projections) -> None:
        shape = model.shape
        # The model's parts, not the model: it holds this decoder, and a cycle would keep a
        # dropped engine's weights until a full collection.
        self.layers, self.embed_tokens = model.layers, model.embed_tokens
        self.backend = model.backend
        self.dtype = model.norm.dtype
        self.max_rows = runs.max_rows
        decode_symbol = cpu_decode.SYMBOLS.get(
            (self.dtype, shape.head_dim), cpu_decode.SYMBOLS[self.dtype, None]
        )
        layer_ops = cpu_layer_ops.KERNEL.built()
        kernel_field = {DENSE: "gemm", INT8: "int8", INT4: "int4"}[runs.weights]
        self.spec = Model(
            norm=_address(layer_ops, cpu_layer_ops.NORM_SYMBOLS[self.dtype]),
            rotary=_address(layer_ops, cpu_layer_ops.ROTARY_SYMBOLS[self.dtype]),
            silu_and_mul=_address(layer_ops, cpu_layer_ops.SILU_SYMBOLS[self.dtype]),
            decode=_address(cpu_decode.KERNEL.built(), decode_symbol),
            cos_sin=model.cos_sin_cache.data_ptr(),
            final_norm=model.norm.data_ptr(),
            weights=runs.weights,
            layers=shape.num_layers,
            hidden=shape.hidden_size,
            intermediate=shape.intermediate_size,
            heads=shape.num_heads,
            kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            eps=shape.rms_norm_eps,
            scale=shape.head_dim**-0.5,
        )
        setattr(self.spec, kernel_field, runs.kernel)
        self.run = getattr(KERNEL.built(), f"decode_layers_{SUFFIXES[self.dtype]}")
        hidden, intermediate = shape.hidden_size, shape.intermediate_size
        query, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        # cpu_decoder.c's workspace: 2 hidden, 3 query, 3 KV and 3 intermediate widths a row,
        # and float32 rows in and out of quantized kernels for a bfloat16 model.
        self.scratch_per_row = 3 * (query + kv + intermediate) + 2 * hidden
        quantized_bfloat16 = runs.weights != DENSE and self.dtype == torch.bfloat16
        self.floats_per_row = (
            max(hidden, query, intermediate) + max(query + 2 * kv, hidden, 2 * intermediate)
            if quantized_bfloat16
            else 0
        )
        self._caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._layers = (Layer * shape.num_layers)()

    def takes(self, meta: AttentionMetadata, backend: Backend) -> bool:
        """Whether a step of ``meta`` (without adapter rows) on the model's current ``backend``
        runs here: decodes only, at most ``max_rows`` of them, on the backend this decoder was
        built with."""
        return (
            meta.max_query_len == 1
            and meta.num_tokens == meta.num_seqs
            and 0 < meta.num_tokens <= self.max_rows
            and backend is self.backend
        )

    def _layers_for(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ctypes.Array:
        if kv_caches is not self._caches:
            for layer, spec, (key_cache, value_cache) in zip(
                self.layers, self._layers, kv_caches, strict=True
            ):
                if key_cache.dtype != self.dtype or (layer.k_scale, layer.v_scale) != (1.0, 1.0):
                    raise ValueError("the C decoder reads unscaled caches of the model's dtype")
                bias = layer.qkv_proj.bias
                spec.input_norm = layer.input_layernorm.data_ptr()
                spec.post_norm = layer.post_attention_layernorm.data_ptr()
                spec.qkv_bias = None if bias is None else bias.data_ptr()
                for name in PROJECTIONS:
                    operands = _operands(getattr(layer, name))
                    addresses = (None if t is None else t.data_ptr() for t in operands)
                    setattr(spec, name, Projection(*addresses))
                spec.key_cache = key_cache.data_ptr()
                spec.value_cache = value_cache.data_ptr()
            self.spec.block_size = kv_caches[0][0].shape[1]
            self._caches = kv_caches
        return self._layers

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final norm's output ``[rows, hidden]`` for a step :meth:`takes`."""
        layers = self._layers_for(kv_caches)
        hidden = self.embed_tokens(input_ids)
        residual = torch.empty_like(hidden)
        scratch = torch.empty(meta.num_tokens * self.scratch_per_row, dtype=self.dtype)
        floats = torch.empty(meta.num_tokens * self.floats_per_row) if self.floats_per_row else None
        # Every operand is held by a name for the whole call: ctypes gets bare addresses.
        positions = positions.to(torch.int64)
        slots = meta.slot_mapping.to(torch.int64)
        block_tables = meta.block_tables.to(torch.int64).contiguous()
        seq_lens = meta.seq_lens.to(torch.int64)
        self.run(
            ctypes.addressof(self.spec),
            ctypes.addressof(layers),
            hidden.data_ptr(),
            residual.data_ptr(),
            scratch.data_ptr(),
            None if floats is None else floats.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            meta.num_tokens,
            block_tables.shape[1],
        )
        return hidden


def for_model(model: LlamaForCausalLM, kernels: KernelCapabilities) -> CpuDecoder | None:
    """The C decoder of ``model`` where it can run: a bfloat16 or float32 model on the cpu
    backend with the norms and rotary in C, its projections' decode rows in a C kernel
    (:func:`projections`); else None."""
    dtype = model.norm.dtype
    shape = model.shape
    if (
        model.backend.name != "cpu"
        or not (kernels.cpu_decoder and kernels.cpu_decode and kernels.cpu_layer_ops)
        or dtype not in SUFFIXES
        or model.norm.device.type != "cpu"
        or model.cos_sin_cache.dtype != torch.float32
        or shape.head_dim > cpu_layer_ops.MAX_HEAD_DIM
        or shape.head_dim % 2
    ):
        return None
    modules = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
    runs = projections(modules, dtype, kernels)
    if runs is None or not all(
        t is None or t.is_contiguous() for m in modules for t in _operands(m)
    ):
        return None
    return CpuDecoder(model, runs)
