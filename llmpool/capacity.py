"""KV-cache sizing: the one formula shared by the engine, the operator and `llmpool plan`."""

from __future__ import annotations

from dataclasses import dataclass

KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers that decide KV and weight memory."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_parameters: int
    max_position_embeddings: int


# Shapes of models the operator can size without loading them.
BUILTIN_MODEL_SHAPES = {
    "smollm2-135m-instruct": ModelShape(
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        num_parameters=134_515_008,
        max_position_embeddings=8192,
    ),
}


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """``2 (K and V) × layers × kv_heads × head_dim × bytes``."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * KV_DTYPE_BYTES[kv_dtype]


def kv_bytes_per_block(shape: ModelShape, kv_dtype: str, block_size: int) -> int:
    return kv_bytes_per_token(shape, kv_dtype) * block_size


def num_kv_blocks(shape: ModelShape, kv_dtype: str, block_size: int, memory_bytes: int) -> int:
    """How many whole blocks fit in ``memory_bytes``."""
    return memory_bytes // kv_bytes_per_block(shape, kv_dtype, block_size)


def max_concurrent_sequences(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """Sequences that fit at once when every one of them reaches ``max_model_len`` tokens."""
    blocks_per_sequence = -(-max_model_len // block_size)
    return num_blocks // blocks_per_sequence
