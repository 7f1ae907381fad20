"""status.capacity of a pool, and the specs that cannot work, from the shared KV sizing formula."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmpool import capacity
from llmpool.operator.engine_args import quantity_bytes
from llmpool.operator.spec import PoolSpec

GPU_RESOURCE_SUFFIX = "/gpu"  # nvidia.com/gpu, amd.com/gpu
# Host memory of an engine beyond its weights and KV cache: Python, torch, the tokenizer, step
# activations, the HTTP server. An allowance, not a measurement: above the ~1.2 GiB that the
# example pool's 2Gi limit leaves beside its float32 weights and 256Mi of KV cache.
ENGINE_RUNTIME_BYTES = 1536 * 2**20
MEBIBYTE = 2**20


@dataclass(frozen=True)
class Sizing:
    capacity: dict[str, Any]
    problems: list[str] = field(default_factory=list)


def on_gpu(spec: PoolSpec) -> bool:
    resources = {**spec.resources.get("requests", {}), **spec.resources.get("limits", {})}
    return any(name.endswith(GPU_RESOURCE_SUFFIX) for name in resources)


def kv_dtype(spec: PoolSpec) -> str:
    """The KV-cache dtype a replica will use: ``auto`` follows the engine's dtype, which is
    bfloat16 on an accelerator and float32 on CPU (a pool without a GPU resource)."""
    if spec.kv_cache_dtype == "fp8":
        return "fp8"
    return "bfloat16" if on_gpu(spec) else "float32"


def weight_dtype(spec: PoolSpec) -> str:
    """The dtype of the weights and LoRA slots as loaded, before any quantization: the widest
    ``auto`` can pick, bfloat16 on an accelerator and float32 on CPU."""
    return "bfloat16" if on_gpu(spec) else "float32"


def lora_bytes(spec: PoolSpec, shape: capacity.ModelShape) -> int:
    """Memory of the pool's LoRA slots (0 with LoRA off): the engine allocates ``maxLoras``
    slots of ``maxLoraRank`` at start, whether or not adapters are loaded."""
    lora = spec.lora_settings
    if lora is None:
        return 0
    return lora.max_loras * capacity.lora_slot_bytes(shape, lora.max_lora_rank, weight_dtype(spec))


def builtin_shape(source: str) -> capacity.ModelShape | None:
    if not source.startswith("builtin://"):
        return None
    return capacity.BUILTIN_MODEL_SHAPES.get(source.removeprefix("builtin://"))


def size_pool(spec: PoolSpec) -> Sizing:
    """KV bytes per token and sequences that fit, plus why the spec cannot be served, if so."""
    shape = builtin_shape(spec.source)
    if shape is None:
        return Sizing({"message": "sizing needs the model's shape; known for built-in models only"})
    dtype = kv_dtype(spec)
    result: dict[str, Any] = {"kvBytesPerToken": capacity.kv_bytes_per_token(shape, dtype)}
    if spec.lora_settings is not None:
        result["loraBytes"] = lora_bytes(spec, shape)
    problems = []
    if spec.max_model_len > shape.max_position_embeddings:
        problems.append(
            f"maxModelLen is {spec.max_model_len:,}; the model's context is "
            f"{shape.max_position_embeddings:,} tokens"
        )
    if spec.engine.kv_cache_memory is None:
        result["message"] = "set engine.kvCacheMemory to size the KV cache per replica"
    else:
        memory = quantity_bytes(spec.engine.kv_cache_memory)
        block_size = spec.pin.block_size
        blocks = capacity.num_kv_blocks(shape, dtype, block_size, memory)
        result["kvBlocks"] = blocks
        result["maxSequences"] = capacity.max_concurrent_sequences(
            blocks, block_size, spec.max_model_len
        )
        if result["maxSequences"] == 0:
            problems.append(
                f"engine.kvCacheMemory holds {blocks * block_size:,} tokens of KV cache; "
                f"one sequence of maxModelLen needs {spec.max_model_len:,}"
            )
    if problems:
        result["message"] = "; ".join(problems)
    return Sizing(result, problems)


def default_memory_limit(spec: PoolSpec) -> str | None:
    """The engine container's memory limit when the spec sets none: the weights as loaded,
    before any quantization (float32 on CPU, the widest ``auto`` can pick), the KV cache and
    the LoRA slots when they live in host memory (CPU), and the runtime. None when that cannot be known: a model without
    a known shape, or a CPU pool whose KV cache the engine sizes from the node (no
    ``engine.kvCacheMemory``)."""
    shape = builtin_shape(spec.source)
    if shape is None:
        return None
    weights = capacity.weight_bytes(shape, weight_dtype(spec))
    host_buffers = 0
    if not on_gpu(spec):
        if spec.engine.kv_cache_memory is None:
            return None
        host_buffers = quantity_bytes(spec.engine.kv_cache_memory) + lora_bytes(spec, shape)
    total = weights + host_buffers + ENGINE_RUNTIME_BYTES
    return f"{-(-total // MEBIBYTE)}Mi"
