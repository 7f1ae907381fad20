"""A seeded request's random draws: keyed by its seed and the output position being sampled.

Two things made a seeded request's tokens depend on more than its seed, prompt and parameters.
A per-request ``torch.Generator`` advanced once per sampled token tied every token to how many
draws came before it (a batch sampled row by row again after a failure drew twice). And one
uniform found in the running sum of the probabilities (the unseeded draw) moves to another
token when the logits move in their last bits, as they do between a prefix-cache hit and miss,
a recompute after preemption and another batch (GEMMs and attention of other sizes round
otherwise): over a flat distribution the sum's error before a token is larger than the token's
own probability. So a seeded row races its tokens instead: the token with the largest
``p / E``, ``E`` exponential noise over the vocabulary drawn from a generator seeded by
SplitMix64 of ``(seed, position)``. That is a pure function of the seed and the position, and a
move of the logits in their last bits changes the winner only at a near-tie of the race.
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix(value: int) -> int:
    """SplitMix64's finalizer (Steele, Lea and Flood 2014): a bijection of 64-bit integers."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def position_seed(seed: int, position: int) -> int:
    """The 64-bit seed of output position ``position``'s draw for a request seeded with
    ``seed`` (any integer, taken modulo 2**64 as torch's ``manual_seed`` does): SplitMix64's
    ``position``-th output of the stream that ``seed`` starts, so consecutive seeds (choice ``i``
    of ``n`` uses ``seed + i``) and positions give unrelated draws."""
    stream = _mix(seed & _MASK)
    return _mix((stream + (position + 1) * _GAMMA) & _MASK)


def race(probs: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """Each row's token drawn from its (unnormalized, non-negative) ``probs``: the argmax of
    ``probs / E``, with ``E`` standard exponential noise from the row's position seed. A token
    of probability 0 never wins: a row always has a kept token, whose ratio is above 0."""
    noise = torch.empty_like(probs)
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        generator = torch.Generator().manual_seed(position_seed(seed, position))
        noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
