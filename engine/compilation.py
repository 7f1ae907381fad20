"""Compiling the decoder for every step size before it runs any, so that serving never compiles
mid-traffic.

``LlamaForCausalLM.compiled_decoder`` wraps the decoder in ``torch.compile`` with dynamic sizes.
Dynamo still makes a graph per branch a size takes: one token (0/1 specialization), and each
threshold the GEMMs branch on (``linear.CPU_TRANSPOSED_MAX_ROWS``,
``linear.BFLOAT16_KERNEL_MAX_ROWS``, ``linear.BFLOAT16_UPCAST_MIN_ROWS``, the int8 kernel's
rows).
Those thresholds sit at powers of two, so ``compile_sizes`` runs one forward at 1, at every
power of two and one past it, and at the step's largest size, before the engine switches to the
compiled decoder (``engine/background_compile.py``); ``test_engine_vs_hf.py``'s "compiled" case
checks that nothing compiles after that.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

import torch
import torch.fx.experimental._config

from llmpool.engine.attention import AttentionMetadata
from llmpool.engine.attention.step import step_attention
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
) -> tuple[Callable[..., torch.Tensor], int]:
    """The compiled decoder, compiled and run at every size of ``compile_sizes``, and the
    number of graphs that made.

    The forwards write scratch KV caches shaped like ``kv_caches`` (the engine's, which serve
    requests meanwhile), one sequence from slot 0. Duck sizing is off while they trace: the
    scratch pool's block count must stay a size of its own, or a step size that happened to
    equal it would tie the two in a guard that the engine's pool then fails.
    """
    compiled = model.compiled_decoder()
    scratch = scratch_kv_caches(kv_caches, -(-max_tokens // block_size))
    before = num_compiled_graphs()
    device = model.cos_sin_cache.device
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        for size in compile_sizes(max_tokens):
            meta = AttentionMetadata.one_sequence(size, block_size, device)
            input_ids = torch.zeros(size, dtype=torch.int64, device=device)
            with step_attention(model.backend, meta):
                compiled(input_ids, torch.arange(size, device=device), scratch)
    return compiled, num_compiled_graphs() - before


def scratch_kv_caches(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed caches of ``num_blocks`` blocks, each layer's shaped and typed like ``kv_caches``'.

    Made inside or outside inference mode as the engine's were: dynamo guards on a tensor's
    dispatch keys, and graphs traced on inference-tensor caches recompile for the engine's."""
    with torch.inference_mode(kv_caches[0][0].is_inference()):
        return [
            (
                key.new_zeros((num_blocks, *key.shape[1:])),
                value.new_zeros((num_blocks, *value.shape[1:])),
            )
            for key, value in kv_caches
        ]
