"""Attention backends: which kernels a model runs, chosen once from the device."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from llmpool.engine import ops
from llmpool.engine.attention import cpu_backend, torch_backend
from llmpool.engine.attention.metadata import AttentionMetadata
from llmpool.engine.kernels import cpu_decode, cpu_layer_ops
from llmpool.engine.kernels.capabilities import KernelCapabilities
from llmpool.engine.kernels.cpu_lora import cpu_lora_add
from llmpool.engine.kv_cache import FP8_DTYPE
from llmpool.engine.lora.ops import torch_lora_add, torch_lora_plan
from llmpool.engine.models.linear import TORCH_GEMMS, GemmChoice

__all__ = ["TORCH", "AttentionMetadata", "Backend", "check_kv_cache_dtype", "select_backend"]

# Triton converts to and from e4m3 with instructions NVIDIA GPUs have from this one on (Ada, Hopper).
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Backend:
    """The kernels of one implementation; every field has the torch reference's signature."""

    name: str
    plan: Callable[[AttentionMetadata], Any]
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    lora_plan: Callable[..., Any]
    lora_add: Callable[..., None]


def torch_backend_with(gemm: GemmChoice) -> Backend:
    """The torch reference, its LoRA GEMMs chosen as the engine's layers choose theirs."""
    return Backend(
        name="torch",
        plan=torch_backend.plan,
        write_kv=torch_backend.write_kv,
        paged_attention=torch_backend.paged_attention,
        rms_norm=ops.rms_norm,
        fused_add_rms_norm=ops.fused_add_rms_norm,
        rotary_embedding=ops.rotary_embedding,
        silu_and_mul=ops.silu_and_mul,
        lora_plan=torch_lora_plan,
        lora_add=functools.partial(torch_lora_add, gemm=gemm),
    )


# torch's own GEMMs throughout: the reference other backends are tested against.
TORCH = torch_backend_with(TORCH_GEMMS)


def cpu_backend_with(kernels: KernelCapabilities) -> Backend:
    """The torch backend with decodes attended in ``cpu_decode.c`` and, where they are built,
    multi-token queries in ``cpu_prefill.c``, adapter deltas added in ``cpu_lora.c`` and norms,
    rotary and SiLU-and-mul in ``cpu_layer_ops.c``."""
    backend = replace(
        torch_backend_with(kernels.gemm),
        name="cpu",
        plan=functools.partial(cpu_backend.plan, prefill_kernel=kernels.cpu_prefill),
        paged_attention=cpu_backend.paged_attention,
    )
    if kernels.cpu_lora:
        backend = replace(backend, lora_add=functools.partial(cpu_lora_add, gemm=kernels.gemm))
    if kernels.cpu_layer_ops:
        backend = replace(
            backend,
            rms_norm=cpu_layer_ops.rms_norm,
            fused_add_rms_norm=cpu_layer_ops.fused_add_rms_norm,
            rotary_embedding=cpu_layer_ops.rotary_embedding,
            silu_and_mul=cpu_layer_ops.silu_and_mul,
        )
    return backend


def select_backend(
    device: torch.device,
    name: str = "auto",
    kv_cache_dtype: torch.dtype | None = None,
    *,
    kernels: KernelCapabilities,
) -> Backend:
    """``auto`` picks Triton on CUDA, and torch for an fp8 KV cache on a GPU whose Triton cannot
    convert e4m3, so that a pool's kvCacheDtype fp8 runs on any GPU. On CPU it picks the cpu
    backend (torch's, with decodes in ``cpu_decode.c``) for bfloat16 and float32 caches where a
    C compiler built the kernel, else torch."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
            if kv_cache_dtype == FP8_DTYPE and not _triton_has_fp8(device):
                name = "torch"
        elif (
            device.type == "cpu"
            and (kv_cache_dtype is None or kv_cache_dtype in cpu_decode.KERNEL_DTYPES)
            and kernels.cpu_decode
        ):
            name = "cpu"
        else:
            name = "torch"
    if name == "torch":
        return torch_backend_with(kernels.gemm)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on CPU, not {device.type}")
        if not kernels.cpu_decode:
            raise ValueError(
                "the cpu attention backend needs a C compiler (gcc) to build its kernel"
            )
        return cpu_backend_with(kernels)
    if name == "triton":
        from llmpool.engine.attention.triton_backend import TRITON

        return TRITON
    raise ValueError(f"unknown attention backend {name!r}; expected auto, torch, cpu or triton")


def _triton_has_fp8(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def check_kv_cache_dtype(backend: Backend, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse at start a cache dtype that an explicitly chosen backend's first step would fail to
    compile for (``auto`` never chooses such a backend)."""
    if backend.name == "cpu":
        cpu_backend.check_cache_dtype(dtype)
    if dtype == FP8_DTYPE and backend.name == "triton" and device.type == "cuda":
        check_fp8_capability(
            torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
        )


def check_fp8_capability(capability: tuple[int, int], device_name: str) -> None:
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"kv_cache_dtype fp8 on the Triton backend needs a GPU of compute capability"
            f" {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer (Ada, Hopper);"
            f" {device_name} has {capability[0]}.{capability[1]}. Use kv_cache_dtype auto,"
            " or attention_backend torch"
        )
