"""Compiling the decoder at start, so that serving never compiles mid-traffic.

``LlamaForCausalLM.compile_decoder`` wraps the decoder in ``torch.compile`` with dynamic sizes.
Dynamo still makes a graph per branch a size takes: one token (0/1 specialization), and each
threshold the GEMMs branch on (``linear.CPU_TRANSPOSED_MAX_ROWS``,
``linear.BFLOAT16_KERNEL_MAX_ROWS``, ``linear.BFLOAT16_UPCAST_MIN_ROWS``, the int8 kernel's
rows).
Those thresholds sit at powers of two, so ``compile_sizes`` runs one forward at 1, at every
power of two and one past it, and at the step's largest size, before the engine takes a
request; ``test_engine_vs_hf.py``'s "compiled" case checks that nothing compiles after that.
"""

from __future__ import annotations

import shutil

import torch

from llmpool.engine.attention import AttentionMetadata
from llmpool.engine.models.llama import LlamaForCausalLM


def check_can_compile(device: torch.device) -> None:
    """Refuse at start what the first compile would fail on."""
    if device.type != "cpu":
        raise ValueError(
            f"compile is built for CPU; on {device.type} the engine runs eager (CUDA graphs are"
            " not built yet)"
        )
    if shutil.which("g++") is None and shutil.which("c++") is None:
        raise ValueError("compile needs a C++ compiler (g++) for inductor's CPU kernels")


def compile_sizes(max_tokens: int) -> list[int]:
    """1, every power of two and one past it up to ``max_tokens``, and ``max_tokens``."""
    sizes = {1, max_tokens}
    power = 2
    while power <= max_tokens:
        sizes.update((power, min(power + 1, max_tokens)))
        power *= 2
    return sorted(sizes)


def num_compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@torch.inference_mode()
def compile_all_sizes(
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    max_tokens: int,
) -> int:
    """Compile and run the decoder at every size of ``compile_sizes``; returns the graphs made.

    Each forward is one sequence written from slot 0 of the (still empty) pool: the blocks are
    free, no prefix-cache hash points at them, and a request overwrites its slots before it
    reads them.
    """
    model.compile_decoder()
    before = num_compiled_graphs()
    device = model.cos_sin_cache.device
    for size in compile_sizes(max_tokens):
        meta = AttentionMetadata.one_sequence(size, block_size, device)
        input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        model(input_ids, torch.arange(size, device=device), kv_caches, meta)
    return num_compiled_graphs() - before
