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
# The engine's defaults (EngineConfig.max_loras, max_lora_rank), as vLLM's.
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
MAX_LORAS = 64
MAX_LORA_RANK = 256


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
    max_loras: int  # 0: LoRA off
    max_lora_rank: int
    lora_bytes: int
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
    max_loras: int = 0,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
) -> Plan:
    """Weights first, then ``max_loras`` LoRA slots of rank ``max_lora_rank`` (0: LoRA off;
    the engine allocates them before its KV pool); the KV pool gets what is left of
    ``memory_bytes``, in whole blocks."""
    shape = model_shape(model)
    max_model_len = max_model_len or shape.max_position_embeddings
    if max_model_len > shape.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len:,} exceeds the model's context length"
            f" {shape.max_position_embeddings:,}"
        )
    if max_loras and not (1 <= max_loras <= MAX_LORAS and 1 <= max_lora_rank <= MAX_LORA_RANK):
        raise ValueError(
            f"max_loras must be in 1..{MAX_LORAS} and max_lora_rank in 1..{MAX_LORA_RANK}"
            f" (the engine's limits), got {max_loras} and {max_lora_rank}"
        )
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    weights = capacity.weight_bytes(shape, dtype, quantization)
    lora_bytes = max_loras * capacity.lora_slot_bytes(shape, max_lora_rank, dtype)
    kv_cache_bytes = memory_bytes - weights - lora_bytes
    if kv_cache_bytes <= 0:
        slots = f" and {max_loras} LoRA slot(s) {lora_bytes:,}" if max_loras else ""
        raise ValueError(
            f"the weights need {weights:,} bytes{slots}; the memory given is {memory_bytes:,} bytes"
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
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        lora_bytes=lora_bytes,
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
        *(
            [
                (
                    "LoRA slots",
                    f"{size(plan.lora_bytes)}, {plan.max_loras} of rank {plan.max_lora_rank}",
                )
            ]
            if plan.max_loras
            else []
        ),
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
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="count LoRA adapter slots (implied by --max-loras or --max-lora-rank)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help=f"resident LoRA adapters, one slot each (default {DEFAULT_MAX_LORAS})",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help=f"rank every slot is sized for (default {DEFAULT_MAX_LORA_RANK})",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lora = args.enable_lora or args.max_loras is not None or args.max_lora_rank is not None
    try:
        plan = make_plan(
            args.model,
            parse_bytes(args.memory),
            args.max_model_len,
            args.dtype,
            args.kv_cache_dtype,
            args.quantization,
            args.block_size,
            max_loras=(DEFAULT_MAX_LORAS if args.max_loras is None else args.max_loras)
            if lora
            else 0,
            max_lora_rank=DEFAULT_MAX_LORA_RANK
            if args.max_lora_rank is None
            else args.max_lora_rank,
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
