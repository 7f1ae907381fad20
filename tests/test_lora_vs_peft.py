"""LoRA parity: the engine's greedy output with adapters equals HF transformers + PEFT's.

Two adapters are made with PEFT itself (random non-zero weights, ranks 8 and 16, different
target modules) from the built-in model; the reference is ``PeftModel`` in float32, one prompt
at a time. The engine runs each adapter alone, then both mixed with base-model requests in one
batch, with prefix caching on and off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmpool.engine.llm import LLM
from llmpool.engine.lora import LoRARequest
from llmpool.engine.sampling_params import SamplingParams
from tests.conftest import PROMPTS, greedy_continuation

NEW_TOKENS = 24
LORA_PROMPTS = [PROMPTS[0], PROMPTS[3], PROMPTS[5]]
ADAPTERS = {
    "alpha": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "beta": {
        "r": 16,
        "lora_alpha": 32,
        "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj"],
    },
}


@pytest.fixture(scope="module")
def peft_adapters(
    tmp_path_factory: pytest.TempPathFactory, builtin_folder: Path
) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("peft-adapters")
    folders = {}
    for seed, (name, settings) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(builtin_folder, dtype=torch.float32)
        config = LoraConfig(init_lora_weights=False, **settings)  # random A and B, not B = 0
        get_peft_model(base, config).save_pretrained(root / name)
        folders[name] = root / name
    return folders


@pytest.fixture(scope="module")
def peft_reference(
    peft_adapters: dict[str, Path], builtin_folder: Path
) -> dict[str, list[list[int]]]:
    """Each adapter's greedy continuation of each prompt, by ``PeftModel.generate``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin_folder)
    reference = {}
    for name, folder in peft_adapters.items():
        base = AutoModelForCausalLM.from_pretrained(builtin_folder, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, folder).eval()
        with torch.inference_mode():
            reference[name] = [
                greedy_continuation(model, tokenizer, prompt, NEW_TOKENS) for prompt in LORA_PROMPTS
            ]
    return reference


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def lora_llm(request: pytest.FixtureRequest) -> LLM:
    return LLM(
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        dtype="float32",
        max_model_len=1024,
        enable_prefix_caching=request.param,
    )


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def _lora_request(name: str, folders: dict[str, Path]) -> LoRARequest:
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, str(folders[name]))


def test_each_adapter_alone_matches_peft(
    lora_llm: LLM, peft_adapters: dict[str, Path], peft_reference: dict[str, list[list[int]]]
) -> None:
    for name in ADAPTERS:
        outputs = lora_llm.generate(
            LORA_PROMPTS, _greedy(), lora_request=_lora_request(name, peft_adapters)
        )
        assert [o.outputs[0].token_ids for o in outputs] == peft_reference[name], name


def test_adapters_and_base_in_one_batch_match_their_references(
    lora_llm: LLM,
    peft_adapters: dict[str, Path],
    peft_reference: dict[str, list[list[int]]],
    hf_greedy_reference: dict[tuple[int, ...], list[int]],
) -> None:
    """Every prompt three times in one ``generate``: base, alpha and beta rows share each step.
    Run twice, so that with prefix caching on the second run finds the first one's blocks."""
    tokenizer = lora_llm.tokenizer
    base = [hf_greedy_reference[tuple(tokenizer.encode(p))][:NEW_TOKENS] for p in LORA_PROMPTS]
    expected = {None: base, **peft_reference}
    names: list[str | None] = [None, *ADAPTERS]
    prompts = [p for p in LORA_PROMPTS for _ in names]
    adapters = [
        None if n is None else _lora_request(n, peft_adapters) for _ in LORA_PROMPTS for n in names
    ]
    for _ in range(2):
        outputs = lora_llm.generate(prompts, _greedy(), lora_request=adapters)
        got = [o.outputs[0].token_ids for o in outputs]
        for index, name in enumerate(names):
            assert got[index :: len(names)] == expected[name], name
    # A no-op adapter would pass the comparisons above: each must change some continuation.
    assert len({tuple(map(tuple, expected[name])) for name in names}) == len(names)
