"""LoRA adapters served beside the base model: many fine-tunes in one batch, never merged.

An adapter is PEFT's folder (``adapter_config.json`` + ``adapter_model.safetensors``), read by
:mod:`adapter`, installed into one of ``max_loras`` preallocated slots by :mod:`manager`, and
applied per row group in every step by :mod:`ops`. The model's fused projections take the
deltas of their parts: q, k and v go into ``qkv_proj``; gate and up into ``gate_up_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

QKV, O_PROJ, GATE_UP, DOWN = range(4)
NUM_MODULES = 4

# PEFT's module name -> (fused module of llama.py, index of its part).
LORA_TARGETS: dict[str, tuple[int, int]] = {
    "q_proj": (QKV, 0),
    "k_proj": (QKV, 1),
    "v_proj": (QKV, 2),
    "o_proj": (O_PROJ, 0),
    "gate_proj": (GATE_UP, 0),
    "up_proj": (GATE_UP, 1),
    "down_proj": (DOWN, 0),
}


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's handle for an adapter: a name requests use, and the folder it is read from."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    revision: str | None = None  # sha256:<hex> of the adapter's files; refused if they differ
