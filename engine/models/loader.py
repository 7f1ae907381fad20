"""Load a Hugging Face Llama-family checkpoint folder into our model, fusing q/k/v and gate/up."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from llmpool.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# HF parameter suffix -> (our parameter in the layer, index of the shard in the fused weight)
_FUSED = {
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
}
_RENAMED = {
    "self_attn.o_proj": "o_proj",
    "mlp.down_proj": "down_proj",
}


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    """Copy every checkpoint tensor into its place; fail on a missing or unexpected tensor."""
    layer_params = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = _load_tensor(model, name, reader.get_tensor(name))
                if target is not None:
                    loaded.add(target)
    # Fused weights are counted once per shard; tied heads share the embedding.
    missing = {name for name in layer_params if name not in loaded}
    if model.shape.tie_word_embeddings:
        missing.discard("lm_head")
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks tensors for: {sorted(missing)[:8]}")


def _load_tensor(model: LlamaForCausalLM, name: str, tensor: torch.Tensor) -> str | None:
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return _copy(model.embed_tokens.weight, tensor, "embed_tokens.weight")
    if name == "norm.weight":
        return _copy(model.norm, tensor, "norm")
    if name == "lm_head.weight":
        if model.shape.tie_word_embeddings:
            return None
        return _copy(model.lm_head, tensor, "lm_head")
    if not name.startswith("layers."):
        if "rotary_emb" in name:
            return None
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    _, index, rest = name.split(".", 2)
    layer = model.layers[int(index)]
    prefix = f"layers.{index}."
    module_name, _, kind = rest.rpartition(".")
    if rest == "input_layernorm.weight":
        return _copy(layer.input_layernorm, tensor, prefix + "input_layernorm")
    if rest == "post_attention_layernorm.weight":
        return _copy(layer.post_attention_layernorm, tensor, prefix + "post_attention_layernorm")
    if module_name in _RENAMED:
        target = _RENAMED[module_name]
        return _copy(getattr(getattr(layer, target), kind), tensor, f"{prefix}{target}.{kind}")
    if module_name in _FUSED:
        target, shard = _FUSED[module_name]
        fused = getattr(getattr(layer, target), kind)
        sizes = layer.split_sizes if target == "qkv_proj" else [fused.shape[0] // 2] * 2
        start = sum(sizes[:shard])
        _copy(fused[start : start + sizes[shard]], tensor, f"{prefix}{module_name}.{kind}")
        return f"{prefix}{target}.{kind}"
    raise ValueError(f"unexpected tensor {name!r} in checkpoint")


def _copy(destination: torch.Tensor, source: torch.Tensor, name: str) -> str:
    if destination.shape != source.shape:
        raise ValueError(
            f"tensor {name}: checkpoint shape {tuple(source.shape)}, model shape {tuple(destination.shape)}"
        )
    with torch.no_grad():
        destination.copy_(source)
    return name
