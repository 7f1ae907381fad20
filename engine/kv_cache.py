"""The KV cache's tensors: per layer one paged K and one V tensor, in the model's dtype or in fp8
(e4m3) with a per-layer scale. Which blocks a request owns is ``kv_cache_manager.py``'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmpool.engine import huge_pages

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a cache that ``--kv-cache-dtype`` names (``auto``: the model's)."""
    return FP8_DTYPE if kv_cache_dtype == "fp8" else model_dtype


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed ``(K, V)`` caches of ``[num_blocks, block_size, num_kv_heads, head_dim]``; on the
    CPU each in huge pages (``huge_pages.zeros``: a storage of its own, as a compiled graph
    that writes them needs)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def zeros() -> torch.Tensor:
        if device.type == "cpu":
            return huge_pages.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    return [(zeros(), zeros()) for _ in range(num_layers)]


@dataclass(frozen=True)
class LayerKVCache:
    """One layer's paged K and V, each ``[num_blocks, block_size, kv_heads, head_dim]``, with
    the per-tensor scales they are stored under: an fp8 cache holds ``K / k_scale`` and
    ``V / v_scale``; a cache in the model's dtype holds K and V as they are (scales 1.0).

    What a backend's ``write_kv`` fills and its ``paged_attention`` reads: the scales a block
    was written under are the scales it must be read with, so they travel together.
    """

    key: torch.Tensor
    value: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        check_kv_scales(self.key.dtype, self.k_scale, self.v_scale)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at ±448: what an fp8 KV cache stores for ``x``.

    The division is a multiplication by the fp32 reciprocal, computed in fp32 whatever the
    dtype of ``x``, so that the Triton write kernel can reproduce every byte.
    """
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def check_kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Scales are for fp8 caches only; a cache in the model's dtype holds K and V as they are."""
    if cache_dtype != FP8_DTYPE and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(
            f"KV scales ({k_scale}, {v_scale}) apply to an fp8 cache only, not {cache_dtype}"
        )


# The text an fp8 KV cache's scales are calibrated on (engine_builder): prose, dialogue, code,
# numbers and a little French and German, a few hundred tokens, so that every layer sees
# the kinds of tokens a server is sent. Fixed, so that scales follow from the weights alone.
KV_CALIBRATION_TEXT = (
    "The old lighthouse stood at the end of the harbour wall, and for ninety years its keeper"
    " climbed the spiral stairs each evening to light the lamp. Ships coming in from the north"
    " watched for its beam: two short flashes and one long, every twelve seconds.\n\n"
    "User: Can you explain what a hash table is, in two sentences?\n"
    "Assistant: A hash table stores values under keys and finds them by computing a hash of the"
    " key, which points to a slot in an array. Lookups, inserts and deletes take constant time"
    " on average, as long as collisions are handled well.\n\n"
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
    "    result, i, j = [], 0, 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            result.append(left[i]); i += 1\n"
    "        else:\n"
    "            result.append(right[j]); j += 1\n"
    "    return result + left[i:] + right[j:]\n\n"
    "Quarterly results: revenue rose 12.4% to $3,817 million, operating margin was 21.9%, and"
    " the company expects 2025 sales between 15.2 and 15.8 billion dollars (2024: 14.1).\n"
    "| city | population | area (km2) |\n| Lyon | 522,250 | 47.87 |\n| Graz | 291,072 | 127.6 |\n"
    "Le train de 7 h 42 pour Marseille partira du quai numéro trois avec dix minutes de retard."
    " Der Zug nach München fährt heute wegen Bauarbeiten über Augsburg.\n"
    "Recipe: whisk 3 eggs with 250 ml of milk and 120 g of flour, rest the batter for 30 minutes,"
    " then cook thin pancakes in a hot buttered pan, about one minute per side.\n"
    "In 1905 Einstein published four papers: on the photoelectric effect, Brownian motion,"
    " special relativity, and the equivalence of mass and energy, E = mc^2."
)
# Measured by benchmarks/fp8_kv_scales.py on the built-in model: K/V amax of other texts
# (code, chat, random ids, 1,800 tokens) reached up to 1.42x the calibration text's, and
# saturating costs far more than the precision that headroom gives up (below).
FP8_KV_SCALE_HEADROOM = 4.0


def fp8_kv_scale(amax: float, headroom: float = FP8_KV_SCALE_HEADROOM) -> float:
    """The power-of-two scale that stores ``amax`` at or below ``FP8_MAX / headroom`` in e4m3.

    e4m3 has the same relative precision (3 mantissa bits) from 2**-6 to 448, so within that
    range a scale only decides which values saturate or sink into subnormals; headroom keeps
    values larger than calibration saw from saturating. A power of two makes ``x / scale``
    exact, so the cache rounds K and V exactly as scale 1.0 would wherever both are in
    range. A layer whose K or V is zero throughout calibration keeps 1.0.
    """
    if not math.isfinite(amax):
        raise ValueError(f"a KV amax of {amax} cannot be scaled into e4m3")
    if amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * headroom / FP8_MAX))
