"""How likely the loaded model finds a text: next-token log-probabilities through the paged cache.

What the quantization tests and benchmarks compare numerics by (perplexity, KL divergence from
a float32 reference): one forward of the whole text through the same KV path that serving uses;
and ``rescale_kv``, which gives a model other K and V magnitudes without changing its function.
"""

from __future__ import annotations

import torch

from llmpool.engine.engine_core import EngineCore
from llmpool.engine.models.llama import LlamaForCausalLM
from llmpool.engine.request import Request
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.scheduler import SchedulerOutput


def next_token_log_probs(core: EngineCore, token_ids: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len - 1, vocab]`` (float64) of each next token after each prefix."""
    request = Request("score", token_ids, SamplingParams(max_tokens=1), frozenset())
    manager = core.kv_cache_manager
    assert manager.allocate_slots(request, len(token_ids)), "the text does not fit the KV cache"
    try:
        inputs = core.runner.prepare_inputs(SchedulerOutput([request], [len(token_ids)]))
        with torch.inference_mode():
            hidden = core.model(inputs.input_ids, inputs.positions, core.kv_caches, inputs.meta)
            logits = core.model.compute_logits(hidden[:-1])
    finally:
        manager.free(request)
    return torch.log_softmax(logits.double(), dim=-1)


def perplexity(core: EngineCore, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of every token after the first."""
    log_probs = next_token_log_probs(core, token_ids)
    targets = torch.tensor(token_ids[1:]).unsqueeze(1)
    return float(torch.exp(-log_probs.gather(1, targets).mean()))


def rescale_kv(model: LlamaForCausalLM, key_factor: float, value_factor: float) -> None:
    """K times ``key_factor`` with Q divided by it, V times ``value_factor`` with o_proj's input
    divided by it: the same function (exactly, for powers of two), other K and V magnitudes."""
    shape = model.shape
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    with torch.no_grad():
        for layer in model.layers:
            weight = layer.qkv_proj.weight
            weight[:q_size] /= key_factor
            weight[q_size : q_size + kv_size] *= key_factor
            weight[q_size + kv_size :] *= value_factor
            layer.o_proj.weight /= value_factor
