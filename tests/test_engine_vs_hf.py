"""Greedy generation must match HF transformers token for token, however the engine batches."""

from __future__ import annotations

import pytest

from llmpool.engine import LLM, SamplingParams
from llmpool.engine.compilation import num_compiled_graphs

pytestmark = pytest.mark.slow

CONFIGS = {
    "defaults": {},
    # Prompts of 500+ tokens run as 10+ chunks, mixed with other requests' decodes.
    "chunked-prefill": {"max_num_batched_tokens": 48},
    # 40 blocks of 16 hold 640 tokens, enough for the longest request (555 + 64) alone, while
    # the seven shorter ones together grow past it: requests are preempted and recomputed.
    "preemption": {"num_kv_blocks": 40, "max_model_len": 640},
    "block-size-1": {"block_size": 1},
    "block-size-32": {"block_size": 32},
    # The inductor-compiled decoder, at batch sizes across the GEMM thresholds (1, 2..64, 65+).
    "compiled": {"compile": True, "max_num_batched_tokens": 256},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_greedy_matches_transformers(
    config: dict, hf_greedy_reference: dict, reference_new_tokens: int
) -> None:
    prompts = [list(ids) for ids in hf_greedy_reference]
    assert len(prompts) >= 8
    assert min(map(len, prompts)) <= 5 and max(map(len, prompts)) > 500
    llm = LLM(**({"max_model_len": 2048, "dtype": "float32"} | config))
    params = SamplingParams(
        temperature=0, max_tokens=reference_new_tokens, min_tokens=reference_new_tokens
    )
    graphs_before = num_compiled_graphs()
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy_reference[tuple(prompt)]
        assert output.outputs[0].finish_reason == "length"
    assert num_compiled_graphs() == graphs_before, "every size was compiled at start"
    if "num_kv_blocks" in config:
        assert llm.num_preemptions > 0
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
