"""Shared fixtures: the built-in model, reference prompts of 5 to 500+ tokens, HF generations."""

from __future__ import annotations

import os
from pathlib import Path

# Triton reads this once, at import; whichever test imports it first (HF generate does), the
# kernel tests must find it interpreting on CPU. LLMPOOL_KERNEL_TEST_DEVICE=cuda runs them on GPU.
if os.environ.get("LLMPOOL_KERNEL_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from llmpool.engine import model_source

_PARAGRAPH = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines "
    "were programmed by rewiring panels; later, stored programs let the same hardware run any "
    "procedure written as numbers in memory. Assemblers named those numbers, compilers turned "
    "formulas into instructions, and operating systems shared one machine among many users by "
    "slicing time and paging memory. "
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a short poem about the sea and the wind and the stars at night.",
    "Question: What are three benefits of regular exercise for older adults? Answer:",
    _PARAGRAPH + "Summarize the paragraph above in one sentence:",
    "Translate to French: " + " ".join(["The cat sat on the mat near the door."] * 6),
    _PARAGRAPH * 3 + "What idea connects all of these steps?",
    _PARAGRAPH * 8 + "In conclusion,",
]

REFERENCE_NEW_TOKENS = 64


@pytest.fixture(scope="session")
def reference_new_tokens() -> int:
    return REFERENCE_NEW_TOKENS


@pytest.fixture(scope="session")
def builtin_folder() -> Path:
    return model_source.resolve(None).folder


@pytest.fixture(scope="session")
def hf_greedy_reference(builtin_folder: Path) -> dict[tuple[int, ...], list[int]]:
    """HF ``generate()`` greedy continuations of every reference prompt, one prompt at a time.

    Exactly ``REFERENCE_NEW_TOKENS`` tokens each: EOS is suppressed until then, which is what
    ``SamplingParams(min_tokens=...)`` does too.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin_folder)
    model = AutoModelForCausalLM.from_pretrained(builtin_folder, dtype=torch.float32).eval()
    reference = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=REFERENCE_NEW_TOKENS,
                min_new_tokens=REFERENCE_NEW_TOKENS,
                do_sample=False,
            )
            reference[tuple(ids)] = out[0, len(ids) :].tolist()
    return reference
