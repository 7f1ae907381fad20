"""Any Llama-family HF folder loads by path: Llama (with llama3 rope scaling), Qwen2 (qkv bias), Mistral.

Small randomly initialised checkpoints are written with transformers itself; greedy outputs must
equal transformers' ``generate()`` on the same folder, in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmpool.engine import LLM, SamplingParams
from tests.conftest import small_config


def llama_config():
    from transformers import LlamaConfig

    return small_config(
        LlamaConfig,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    )


def qwen2_config():
    from transformers import Qwen2Config

    return small_config(Qwen2Config, tie_word_embeddings=True)


def mistral_config():
    from transformers import MistralConfig

    return small_config(MistralConfig, sliding_window=None)


@pytest.fixture(scope="module", params=[llama_config, qwen2_config, mistral_config])
def small_checkpoint(request, save_small_checkpoint, tmp_path_factory) -> Path:
    config = request.param()
    return save_small_checkpoint(config, tmp_path_factory.mktemp(config.model_type))


def test_greedy_matches_transformers(small_checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(small_checkpoint), max_model_len=256, block_size=8, dtype="float32")
    prompts = [
        llm.tokenizer.encode(t) for t in ("Hello there", "One two three four five six seven")
    ]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    outputs = llm.generate(prompts, params)

    reference = AutoModelForCausalLM.from_pretrained(small_checkpoint, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
            )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected


def test_bfloat16_loads_and_tracks_float32(small_checkpoint: Path) -> None:
    """bf16 rounds differently from fp32, so only the first tokens are held to agreement."""
    prompt = [[1, 200, 300, 400, 500]]
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)
    fp32 = LLM(str(small_checkpoint), max_model_len=256, dtype="float32").generate(prompt, params)
    bf16_llm = LLM(str(small_checkpoint), max_model_len=256, dtype="bfloat16")
    assert bf16_llm.engine.kv_caches[0][0].dtype == torch.bfloat16
    bf16 = bf16_llm.generate(prompt, params)
    assert bf16[0].outputs[0].token_ids[:2] == fp32[0].outputs[0].token_ids[:2]
