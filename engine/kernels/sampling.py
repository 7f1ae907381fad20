"""Sampling's kernels on CPU: ``sampling.c``, and the calls of it.

- ``greedy_tokens``: each row's argmax of bfloat16 or float32 logits as they are (no float32
  copy, no reduction through torch's TensorIterator); anything else, and every CPU without a C
  compiler, gets torch's ``max``, which chooses the same index (the first of equals, a NaN above
  any number).
- ``keep_thresholds``: each row's min-p, top-k and top-p as one probability threshold, found
  without sorting the vocabulary, and applied; without a compiler, from torch's sort
  (``thresholds_by_sort``).
- ``sample_rows``: a step's random draws in one call, a row at a time in a buffer that stays in
  L2: softmax at the row's temperature, ``keep_thresholds``' filter, and the inverse transform
  of one uniform. torch's ops took ~17 ms at 64 rows of SmolLM2's vocabulary (a float32
  [64, 49152] tensor written and faulted in per op); None where it cannot run, and the sampler
  runs those ops.
"""

from __future__ import annotations

import ctypes

import torch

from llmpool.engine.kernels.c_loader import CKernel

SYMBOLS = {torch.bfloat16: "argmax_bf16", torch.float32: "argmax_f32"}
KERNEL = CKernel(
    "sampling.c",
    {
        **dict.fromkeys(SYMBOLS.values(), [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3),
        "keep_thresholds": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2,
        "sample_rows": [ctypes.c_void_p, ctypes.c_int64]
        + [ctypes.c_void_p] * 8
        + [ctypes.c_int64] * 2,
    },
)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token (int64), the first of equals, as ``argmax`` chooses. torch's
    ``max`` over the last dimension runs 3x as fast as its ``argmax`` on CPU, and this kernel
    ~5x as fast as ``max`` (``benchmarks/sampling.py``)."""
    rows, width = logits.shape
    if (
        logits.dtype not in SYMBOLS
        or not logits.is_cpu
        or logits.stride(1) != 1
        or width == 0
        or not KERNEL.available
    ):
        return logits.max(dim=-1).indices
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        getattr(KERNEL.built(), SYMBOLS[logits.dtype])(
            logits.data_ptr(), out.data_ptr(), rows, width, logits.stride(0)
        )
    return out


def keep_thresholds(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zeroes, in ``probs`` (float32, non-negative, contiguous), each row's tokens below its
    threshold, and returns the thresholds: the highest of ``min_p`` (0: off) times the row's
    largest probability, its ``top_k``-th largest probability (<= 0: off), and the probability at
    which its largest ones first add up to ``top_p`` (>= 1: off); 0 where none applies. Tokens
    tied at a threshold all stay."""
    rows, width = probs.shape
    if not KERNEL.available or not probs.is_cpu or not probs.is_contiguous():
        thresholds = thresholds_by_sort(probs, top_k, top_p, min_p)
        probs.masked_fill_(probs < thresholds[:, None], 0.0)
        return thresholds
    top_k = top_k.to(torch.int64).contiguous()
    top_p, min_p = top_p.to(torch.float32).contiguous(), min_p.to(torch.float32).contiguous()
    out = torch.zeros(rows, dtype=torch.float32)
    if rows and width:
        KERNEL.built().keep_thresholds(
            probs.data_ptr(),
            top_k.data_ptr(),
            top_p.data_ptr(),
            min_p.data_ptr(),
            out.data_ptr(),
            rows,
            width,
        )
    return out


def thresholds_by_sort(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """``keep_thresholds``' thresholds from a sort of every row (the kernel's reference)."""
    rows, width = probs.shape
    if not width:
        return torch.zeros(rows)
    ordered = probs.sort(dim=-1, descending=True).values
    row = torch.arange(rows)
    by_k = ordered[row, (top_k.clamp(1, width) - 1).long()]
    by_k = torch.where((top_k > 0) & (top_k < width), by_k, 0.0)
    reaches = ordered.cumsum(dim=-1) >= top_p[:, None]
    first = reaches.int().argmax(dim=-1)  # the first position whose mass reaches top_p
    by_p = torch.where((top_p < 1) & reaches.any(dim=-1), ordered[row, first], 0.0)
    return torch.maximum(torch.maximum(by_k, by_p), min_p * ordered[:, 0])


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
    skip: torch.Tensor,
    keep_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Each row's token drawn from ``softmax(logits / temperature)`` after ``keep_thresholds``:
    the first token at which the kept probabilities' running sum passes ``uniform`` (in [0, 1))
    times their total, token ``skip`` (-1: none) left out of the draw; and, where
    ``keep_probs``, the kept probabilities (not renormalized; ``skip``'s included). None where
    the kernel does not run: no compiler, logits that are not float32 rows on the CPU, or no
    memory for its row buffer."""
    rows, width = logits.shape
    if (
        not KERNEL.available
        or logits.dtype != torch.float32
        or not logits.is_cpu
        or logits.stride(1) != 1
        or not width
    ):
        return None
    settings = [
        temperature.to(torch.float32).contiguous(),
        top_k.to(torch.int64).contiguous(),
        top_p.to(torch.float32).contiguous(),
        min_p.to(torch.float32).contiguous(),
        uniform.to(torch.float32).contiguous(),
        skip.to(torch.int64).contiguous(),
    ]
    probs = torch.empty(rows, width) if keep_probs else None
    tokens = torch.empty(rows, dtype=torch.int64)
    if rows:
        KERNEL.built().sample_rows(
            logits.data_ptr(),
            logits.stride(0),
            *(setting.data_ptr() for setting in settings),
            None if probs is None else probs.data_ptr(),
            tokens.data_ptr(),
            rows,
            width,
        )
        if bool((tokens < 0).any()):  # a thread's row buffer could not be allocated
            return None
    return tokens, probs
