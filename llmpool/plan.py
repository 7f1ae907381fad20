"""`llmpool plan`: weight and KV-cache memory of a deployment, and how many sequences fit.

The numbers come from llmpool.capacity, the functions the engine sizes its KV pool with at
start-up, and need no weights: the built-in model's shape is known, a folder's is read from its
config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from llmpool import capacity
from llmpool.engine.config import parse_bytes

BUILTIN_PREFIX = "builtin://"
DEFAULT_MODEL = BUILTIN_PREFIX + "smollm2-135m-instruct"


@dataclass(frozen=True)
class Plan:
    model: str
    dtype: str
    quantization: str
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    memory_bytes: int
    weight_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    num_kv_blocks: int
    max_concurrent_sequences: int


def model_shape(model: str) -> capacity.ModelShape:
    """A built-in model's known shape, or the one in a folder's config.json."""
    if model.startswith(BUILTIN_PREFIX) or model in capacity.BUILTIN_MODEL_SHAPES:
        name = model.removeprefix(BUILTIN_PREFIX)
        if name not in capacity.BUILTIN_MODEL_SHAPES:
            known = ", ".join(BUILTIN_PREFIX + n for n in capacity.BUILTIN_MODEL_SHAPES)
            raise ValueError(f"unknown built-in model {model!r}; known: {known}")
        return capacity.BUILTIN_MODEL_SHAPES[name]
    config = Path(model.removeprefix("file://")) / "config.json"
    if not config.is_file():
        raise ValueError(f"{config} does not exist; give a Hugging Face model folder")
    return capacity.model_shape_from_config(json.loads(config.read_text()))


def make_plan(
    model: str,
    memory_bytes: int,
    max_model_len: int | None = None,
    dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
    quantization: str = "none",
    block_size: int = 16,
) -> Plan:
    """Weights first; the KV pool gets what is left of ``memory_bytes``, in whole blocks."""
    shape = model_shape(model)
    max_model_len = max_model_len or shape.max_position_embeddings
    if max_model_len > shape.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len:,} exceeds the model's context length"
            f" {shape.max_position_embeddings:,}"
        )
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    weights = capacity.weight_bytes(shape, dtype, quantization)
    kv_cache_bytes = memory_bytes - weights
    if kv_cache_bytes <= 0:
        raise ValueError(
            f"the weights need {weights:,} bytes; the memory given is {memory_bytes:,} bytes"
        )
    num_blocks = capacity.num_kv_blocks(shape, kv_dtype, block_size, kv_cache_bytes)
    per_token = capacity.kv_bytes_per_token(shape, kv_dtype)
    return Plan(
        model=model,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_dtype,
        block_size=block_size,
        max_model_len=max_model_len,
        memory_bytes=memory_bytes,
        weight_bytes=weights,
        kv_cache_bytes=kv_cache_bytes,
        kv_bytes_per_token=per_token,
        kv_bytes_per_sequence=per_token * max_model_len,
        num_kv_blocks=num_blocks,
        max_concurrent_sequences=capacity.max_concurrent_sequences(
            num_blocks, block_size, max_model_len
        ),
    )


def render(plan: Plan) -> str:
    def size(value: int) -> str:
        return f"{value:,} B ({value / 1024**3:.2f} GiB)"

    rows = [
        ("model", plan.model),
        ("weights", f"{size(plan.weight_bytes)}, {plan.dtype}, quantization {plan.quantization}"),
        ("KV cache dtype", plan.kv_cache_dtype),
        ("KV bytes per token", f"{plan.kv_bytes_per_token:,}"),
        (
            "KV bytes per sequence",
            f"{size(plan.kv_bytes_per_sequence)} at {plan.max_model_len:,} tokens",
        ),
        ("KV cache memory", f"{size(plan.kv_cache_bytes)} of {size(plan.memory_bytes)}"),
        ("KV blocks", f"{plan.num_kv_blocks:,} of {plan.block_size} tokens"),
        ("max concurrent sequences", f"{plan.max_concurrent_sequences:,} at max_model_len"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmpool plan",
        description="Weight and KV-cache memory of a deployment, and how many sequences fit."
        " The KV cache gets the memory the weights leave (activations not counted).",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="builtin://NAME or a model folder")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length; default: the model's"
    )
    parser.add_argument(
        "--memory", required=True, help="memory for weights and KV cache, e.g. 24GiB or 80GB"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(capacity.WEIGHT_DTYPE_BYTES),
        default="bfloat16",
        help="weight dtype (the engine uses bfloat16 on GPUs and on CPUs with native bfloat16,"
        " float32 on other CPUs)",
    )
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument(
        "--quantization", choices=sorted(capacity.QUANTIZATION_BYTES), default="none"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(
            args.model,
            parse_bytes(args.memory),
            args.max_model_len,
            args.dtype,
            args.kv_cache_dtype,
            args.quantization,
            args.block_size,
        )
    except ValueError as error:
        print(f"llmpool plan: {error}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(plan), indent=2) if args.json else render(plan))
    if plan.max_concurrent_sequences == 0:
        print(
            f"llmpool plan: not even one sequence of {plan.max_model_len:,} tokens fits",
            file=sys.stderr,
        )
        return 1
    return 0
