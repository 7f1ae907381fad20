"""KV-cache sizing: the one formula shared by the engine, the operator and `llmpool plan`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
WEIGHT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per weight of the decoder layers under each --quantization (None: the model's dtype).
# int8 also keeps one scale per output channel, under 1% of any layer wider than 100; int4 keeps
# a bfloat16 scale and zero per 32 weights (engine/models/int4.py). The embeddings and the LM
# head are int8 under both (EMBEDDING_QUANTIZED_BYTES).
QUANTIZATION_BYTES: dict[str, float | None] = {"none": None, "int8": 1, "int4": 0.5 + 4 / 32}
EMBEDDING_QUANTIZED_BYTES = 1


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers that decide KV and weight memory."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_parameters: int
    max_position_embeddings: int
    # Of num_parameters, those of the embedding table and an untied LM head.
    embedding_parameters: int
    # What a LoRA slot's size depends on (lora_slot_bytes).
    hidden_size: int
    intermediate_size: int
    num_heads: int


def embedding_parameters(vocab_size: int, hidden_size: int, tie_word_embeddings: bool) -> int:
    return vocab_size * hidden_size * (1 if tie_word_embeddings else 2)


# Shapes of models the operator can size without loading them.
BUILTIN_MODEL_SHAPES = {
    "smollm2-135m-instruct": ModelShape(
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        num_parameters=134_515_008,
        max_position_embeddings=8192,
        embedding_parameters=49_152 * 576,
        hidden_size=576,
        intermediate_size=1536,
        num_heads=9,
    ),
}


def model_shape_from_config(config: dict[str, Any]) -> ModelShape:
    """The shape of a Llama-family checkpoint from its config.json, counting its parameters."""
    hidden = config["hidden_size"]
    num_layers = config["num_hidden_layers"]
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or hidden // num_heads
    vocab = config["vocab_size"]
    qkv_size = (num_heads + 2 * num_kv_heads) * head_dim
    has_qkv_bias = bool(config.get("attention_bias")) or config.get("model_type") == "qwen2"
    per_layer = (
        hidden * qkv_size  # q, k, v projections
        + (qkv_size if has_qkv_bias else 0)
        + num_heads * head_dim * hidden  # o projection
        + 3 * hidden * config["intermediate_size"]  # gate, up, down
        + 2 * hidden  # two RMSNorm weights
    )
    embeddings = embedding_parameters(vocab, hidden, bool(config.get("tie_word_embeddings")))
    return ModelShape(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_parameters=embeddings + num_layers * per_layer + hidden,
        max_position_embeddings=config["max_position_embeddings"],
        embedding_parameters=embeddings,
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_heads=num_heads,
    )


def lora_slot_bytes(shape: ModelShape, max_rank: int, dtype: str) -> int:
    """Memory of one LoRA slot (engine/lora/manager.py): every layer's A and B of all seven
    projections at rank ``max_rank``, in the model's dtype, whatever an adapter targets.

    Per layer and rank: A reads hidden (q, k, v, gate, up), q_size (o) and intermediate (down);
    B writes q_size + 2 kv_size (q, k, v), hidden (o, down) and 2 intermediate (gate, up).
    """
    hidden, inter = shape.hidden_size, shape.intermediate_size
    q_size = shape.num_heads * shape.head_dim
    kv_size = shape.num_kv_heads * shape.head_dim
    per_rank = 7 * hidden + 2 * q_size + 2 * kv_size + 3 * inter
    return shape.num_layers * max_rank * per_rank * WEIGHT_DTYPE_BYTES[dtype]


def weight_bytes(shape: ModelShape, dtype: str, quantization: str = "none") -> int:
    """Memory of the weights: every parameter at ``dtype``'s width, or, when quantized, the
    decoder layers at the quantization's and the embeddings and LM head at int8's."""
    if quantization not in QUANTIZATION_BYTES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_BYTES)}, got {quantization!r}"
        )
    layer_bytes = QUANTIZATION_BYTES[quantization]
    if layer_bytes is None:
        return shape.num_parameters * WEIGHT_DTYPE_BYTES[dtype]
    layer_parameters = shape.num_parameters - shape.embedding_parameters
    embeddings = shape.embedding_parameters * EMBEDDING_QUANTIZED_BYTES
    return embeddings + round(layer_parameters * layer_bytes)


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
