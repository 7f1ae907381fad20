"""Reading a PEFT LoRA folder into per-module (A, B) pairs, checked against the base model.

Everything here is pure and runs on any thread: the server reads an adapter off the event loop
and hands the result to the engine thread, which only copies it into a slot.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llmpool.engine import model_source
from llmpool.engine.lora import LORA_TARGETS

if TYPE_CHECKING:
    from llmpool.engine.models.llama import LlamaShape

CONFIG_FILE, WEIGHTS_FILE = model_source.ADAPTER_FILES
MAX_CONFIG_BYTES = 1 << 20

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT may keep ".default").
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.default)?\.weight$"
)
_LORA_KEY = re.compile(r"^(?:.*\.)?(\w+)\.lora_(?:A|B|embedding_A|embedding_B)(?:\.\w+)?\.weight$")
# Config keys whose non-default values change what the weights mean; the engine refuses them
# rather than serving something other than what PEFT would compute.
_UNSUPPORTED_CONFIG: dict[str, Any] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "lora_bias": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "trainable_token_indices": None,
}

ERROR_CODES = frozenset(
    {
        "adapter_exists",
        "lora_slots_full",
        "invalid_adapter",
        "lora_rank_exceeded",
        "unsupported_target_module",
        "base_model_mismatch",
        "revision_mismatch",
    }
)


class AdapterError(ValueError):
    """An adapter that cannot be served; ``code`` says why (one of ``ERROR_CODES``)."""

    def __init__(self, code: str, message: str, digest: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.digest = digest


@dataclass(frozen=True)
class AdapterInfo:
    """What names and describes an adapter, read or loaded: its files and its PEFT config."""

    name: str
    path: str
    digest: str
    revision: str | None  # what the caller pinned; the files matched it
    rank: int
    alpha: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class AdapterWeights(AdapterInfo):
    """An adapter read and checked: (A ``[r, in]``, B ``[out, r]``) per (layer, PEFT module)."""

    scaling: float
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def module_dims(shape: LlamaShape, module: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of a PEFT target module in the base model."""
    q_size = shape.num_heads * shape.head_dim
    kv_size = shape.num_kv_heads * shape.head_dim
    hidden, inter = shape.hidden_size, shape.intermediate_size
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def read_adapter(
    name: str,
    path: str | Path,
    *,
    shape: LlamaShape,
    max_rank: int,
    dtype: torch.dtype,
    revision: str | None = None,
) -> AdapterWeights:
    """Read and check the adapter at ``path``; raises :class:`AdapterError` naming the fault."""
    folder = Path(path)
    for file in model_source.ADAPTER_FILES:
        if not (folder / file).is_file():
            detail = " (.bin adapters are not read: pickle)" if file == WEIGHTS_FILE else ""
            raise AdapterError("invalid_adapter", f"adapter {name!r}: no {file} in {path}{detail}")
    try:
        digest = model_source.adapter_digest(folder)
    except OSError as error:
        raise AdapterError(
            "invalid_adapter", f"adapter {name!r}: cannot read {path} ({error.strerror})"
        ) from None
    if revision is not None and revision != digest:
        raise AdapterError(
            "revision_mismatch",
            f"adapter {name!r}: the files at {path} are {digest}, not the pinned {revision}",
            digest,
        )
    config = _read_config(name, folder, digest)
    rank, alpha = config["r"], float(config.get("lora_alpha", config["r"]))
    if rank > max_rank:
        raise AdapterError(
            "lora_rank_exceeded",
            f"adapter {name!r} has rank {rank}; this engine's --max-lora-rank is {max_rank}",
            digest,
        )
    _check_targets(name, config.get("target_modules"), digest)
    bound = _weights_bound(shape, rank)
    size = (folder / WEIGHTS_FILE).stat().st_size
    if size > bound:
        raise AdapterError(
            "base_model_mismatch",
            f"adapter {name!r}: {WEIGHTS_FILE} is {size} bytes, more than a rank-{rank} adapter"
            f" of this base model can hold ({bound})",
            digest,
        )
    tensors = _read_tensors(name, folder / WEIGHTS_FILE, shape, rank, dtype, digest)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterWeights(
        name=name,
        path=str(path),
        digest=digest,
        rank=rank,
        alpha=alpha,
        scaling=scaling,
        target_modules=tuple(sorted({module for _, module in tensors})),
        revision=revision,
        tensors=tensors,
    )


def _read_config(name: str, folder: Path, digest: str) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError("invalid_adapter", f"adapter {name!r}: {CONFIG_FILE} is too large")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(
            "invalid_adapter", f"adapter {name!r}: {CONFIG_FILE} is not JSON ({error})", digest
        ) from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(
            "invalid_adapter", f"adapter {name!r}: {CONFIG_FILE} has no peft_type LORA", digest
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError("invalid_adapter", f"adapter {name!r}: r must be a positive integer")
    if not isinstance(config.get("lora_alpha", rank), int | float):
        raise AdapterError("invalid_adapter", f"adapter {name!r}: lora_alpha must be a number")
    for key, default in _UNSUPPORTED_CONFIG.items():
        if config.get(key, default) not in (default, None, {}, []):
            raise AdapterError(
                "invalid_adapter", f"adapter {name!r}: {key} is not supported", digest
            )
    if config.get("bias", "none") != "none":
        raise AdapterError("invalid_adapter", f"adapter {name!r}: bias must be 'none'", digest)
    return config


def _check_targets(name: str, targets: Any, digest: str) -> None:
    """A list of module names must name only projections the engine adapts; a regex or
    ``all-linear`` is judged by the tensor keys instead."""
    if not isinstance(targets, list):
        return
    for target in targets:
        module = str(target).rsplit(".", 1)[-1]
        if module not in LORA_TARGETS:
            raise AdapterError(
                "unsupported_target_module",
                f"adapter {name!r} targets {target!r}; LoRA is served on {', '.join(LORA_TARGETS)}",
                digest,
            )


def _weights_bound(shape: LlamaShape, rank: int) -> int:
    """The largest safetensors file a rank-``rank`` adapter of this model can be: every
    module at float32, plus room for the header."""
    per_layer = sum(sum(module_dims(shape, module)) for module in LORA_TARGETS)
    return shape.num_layers * rank * per_layer * 4 + (1 << 20)


def _read_tensors(
    name: str, file: Path, shape: LlamaShape, rank: int, dtype: torch.dtype, digest: str
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                layer, module, half = _parse_key(name, key, digest)
                if layer >= shape.num_layers:
                    raise AdapterError(
                        "base_model_mismatch",
                        f"adapter {name!r} has layer {layer}; the base model has"
                        f" {shape.num_layers}",
                        digest,
                    )
                halves[(layer, module, half)] = handle.get_tensor(key)
    except AdapterError:
        raise
    except Exception as error:  # a truncated or corrupt file: safetensors' own error types
        raise AdapterError(
            "invalid_adapter", f"adapter {name!r}: {WEIGHTS_FILE} is unreadable ({error})", digest
        ) from None
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, module in sorted({(layer, module) for layer, module, _ in halves}):
        a, b = halves.get((layer, module, "A")), halves.get((layer, module, "B"))
        if a is None or b is None:
            raise AdapterError(
                "invalid_adapter",
                f"adapter {name!r}: layer {layer} {module} has lora_A or lora_B but not both",
                digest,
            )
        in_features, out_features = module_dims(shape, module)
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise AdapterError(
                "base_model_mismatch",
                f"adapter {name!r}: layer {layer} {module} is A {tuple(a.shape)}, B"
                f" {tuple(b.shape)}; this base model needs A ({rank}, {in_features}) and B"
                f" ({out_features}, {rank})",
                digest,
            )
        tensors[(layer, module)] = (a.to(dtype), b.to(dtype))
    if not tensors:
        raise AdapterError("invalid_adapter", f"adapter {name!r} has no LoRA weights", digest)
    return tensors


def _parse_key(name: str, key: str, digest: str) -> tuple[int, str, str]:
    match = _KEY.match(key)
    if match is None or match.group(2) not in LORA_TARGETS:
        other = _LORA_KEY.match(key)
        if other is not None:
            raise AdapterError(
                "unsupported_target_module",
                f"adapter {name!r} adapts {other.group(1)!r}; LoRA is served on"
                f" {', '.join(LORA_TARGETS)}",
                digest,
            )
        raise AdapterError(
            "invalid_adapter", f"adapter {name!r}: unexpected tensor {key!r}", digest
        )
    return int(match.group(1)), match.group(2), match.group(3)


def write_adapter(
    folder: str | Path,
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    *,
    rank: int,
    alpha: float,
    base_model: str = "",
    **config: Any,
) -> str:
    """Write a PEFT-format adapter (for tests, benchmarks and the e2e node); returns its digest.

    ``tensors`` maps (layer, module) to (A ``[rank, in]``, B ``[out, rank]``); ``config``
    overrides keys of ``adapter_config.json``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {}
    for (layer, module), (a, b) in tensors.items():
        part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
        weights[f"{prefix}.lora_A.weight"] = a.contiguous()
        weights[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(weights, str(folder / WEIGHTS_FILE))
    document = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted({module for _, module in tensors}),
        "bias": "none",
        "base_model_name_or_path": base_model,
        "task_type": "CAUSAL_LM",
        **config,
    }
    (folder / CONFIG_FILE).write_text(json.dumps(document, indent=2))
    return model_source.adapter_digest(folder)


def random_adapter(
    folder: str | Path,
    shape: LlamaShape,
    modules: list[str],
    *,
    rank: int,
    alpha: float,
    seed: int,
    std: float = 0.05,
) -> str:
    """A random non-zero adapter of every layer's ``modules`` (tests, benchmarks, e2e)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module in modules:
            in_features, out_features = module_dims(shape, module)
            a = torch.randn(rank, in_features, generator=generator) * std
            b = torch.randn(out_features, rank, generator=generator) * std
            tensors[(layer, module)] = (a, b)
    return write_adapter(folder, tensors, rank=rank, alpha=alpha)
