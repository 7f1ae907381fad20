"""Shared fixtures: the built-in model, reference prompts of 5 to 500+ tokens, HF generations."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Triton reads this once, at import; whichever test imports it first (HF generate does), the
# kernel tests must find it interpreting on CPU. LLMPOOL_KERNEL_TEST_DEVICE=cuda runs them on GPU.
if os.environ.get("LLMPOOL_KERNEL_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from llmpool.engine import model_source
from llmpool.engine.cpu_features import cpu_flags
from llmpool.engine.kernels.c_loader import AVX2_FLAGS, AVX512_FLAGS
from llmpool.engine.lora.ops import LoraBatch, LoraWeights

if TYPE_CHECKING:  # the engine (transformers) is imported by the tests that build one
    from llmpool.engine.engine_core import EngineCore


def needs_cpu(*flags: str) -> pytest.MarkDecorator:
    """Skip where this CPU lacks ``flags`` (every AVX-512 flag of a C kernel's only build, plus
    ``flags``): the skip CI allows, as machines differ. A CPU that has them runs the test, so a
    kernel that fails to build there fails it."""
    return _needs(AVX512_FLAGS | set(flags))


def needs_avx2() -> pytest.MarkDecorator:
    """Skip where this CPU lacks the AVX2 kernels' flags (the skip CI allows, as for
    :func:`needs_cpu`)."""
    return _needs(AVX2_FLAGS)


def _needs(flags: set[str] | frozenset[str]) -> pytest.MarkDecorator:
    missing = sorted(flags - cpu_flags())
    return pytest.mark.skipif(bool(missing), reason=f"this CPU lacks {', '.join(missing)}")


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


# The engines that test_quantization.py and test_fp8_kv_scales.py compare: the built-in model
# with float32 activations, so that only what a test quantizes differs from the reference.
FLOAT32_ENGINE = {"max_model_len": 512, "kv_cache_memory": "64MiB", "dtype": "float32"}


def float32_engine(**config: Any) -> EngineCore:
    from llmpool.engine.config import EngineConfig
    from llmpool.engine.engine_core import EngineCore

    torch.manual_seed(0)
    return EngineCore(EngineConfig(**(FLOAT32_ENGINE | config)))


@pytest.fixture(scope="module")
def fp32_engine() -> EngineCore:
    return float32_engine()


@pytest.fixture(scope="module")
def fp8_kv_engine() -> EngineCore:
    return float32_engine(kv_cache_dtype="fp8")


# A 2-layer model over the built-in tokenizer's vocabulary: what tests that write their own
# checkpoints (save_small_checkpoint) configure. initializer_range 0.1 peaks the logits, so
# that no near-ties let argmax flip between implementations.
SMALL_MODEL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "vocab_size": 49152,
}


def small_config(config_class: Any, **overrides: Any) -> Any:
    """An HF config of ``config_class`` (LlamaConfig, Qwen2Config...) of ``SMALL_MODEL``'s size."""
    return config_class(**(SMALL_MODEL | overrides))


@pytest.fixture(scope="session")
def save_small_checkpoint(builtin_folder: Path) -> Callable[[Any, Path], Path]:
    """Writes a randomly initialised model of an HF config, with the built-in model's tokenizer,
    into a folder that ``LLM(str(folder))`` loads."""

    def save(config: Any, folder: Path) -> Path:
        return write_checkpoint(config, folder, builtin_folder)

    return save


def write_checkpoint(config: Any, folder: Path, builtin_folder: Path) -> Path:
    """A model of ``config`` initialised from seed 0, with the built-in model's tokenizer and
    chat template, saved into ``folder``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(builtin_folder / name, folder / name)
    return folder


def greedy_reference(folder: Path) -> dict[tuple[int, ...], list[int]]:
    """HF ``generate()`` greedy continuations of every reference prompt by the checkpoint in
    ``folder``, one prompt at a time.

    Exactly ``REFERENCE_NEW_TOKENS`` tokens each: EOS is suppressed until then, which is what
    ``SamplingParams(min_tokens=...)`` does too.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tuple(tokenizer.encode(prompt))
            reference[ids] = greedy_continuation(model, tokenizer, prompt, REFERENCE_NEW_TOKENS)
    return reference


@pytest.fixture(scope="session")
def hf_greedy_reference(builtin_folder: Path) -> dict[tuple[int, ...], list[int]]:
    """The built-in model's HF greedy continuations of every reference prompt."""
    return greedy_reference(builtin_folder)


# The built-in model cut to 2 of its 30 layers, random weights: every shape of the real one (its
# heads, grouped-query ratio, MLP, vocabulary and tied embeddings) at a fifteenth of its compute.
# What tests of the engine's machinery run (compiling, switching to a compiled decoder) where
# parity with the real model is not what they check; the HF-parity tests keep the real model.
TINY_LAYERS = 2


@pytest.fixture(scope="session")
def tiny_folder(builtin_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-smollm2"), builtin_folder)


def readable_by_all(folder: Path) -> Path:
    """``folder`` and its files made readable by any user (an image's uid 10001 mounting it);
    safetensors writes its files 0600 and pytest makes its folders 0700."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def write_tiny_checkpoint(folder: Path, builtin_folder: Path) -> Path:
    """The tiny model (``TINY_LAYERS`` of the built-in model's), saved into ``folder``; the e2e
    suite's compiled pool serves it too."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(builtin_folder)
    config.num_hidden_layers = TINY_LAYERS
    # Peaked logits, so that no near-tie lets argmax flip between the engine and HF (as in
    # SMALL_MODEL).
    config.initializer_range = 0.1
    return write_checkpoint(config, folder, builtin_folder)


@pytest.fixture(scope="session")
def tiny_greedy_reference(tiny_folder: Path) -> dict[tuple[int, ...], list[int]]:
    """The tiny model's HF greedy continuations of every reference prompt."""
    return greedy_reference(tiny_folder)


def greedy_continuation(model: Any, tokenizer: Any, prompt: str, tokens: int) -> list[int]:
    """An HF model's ``generate()`` greedy continuation of ``prompt``, exactly ``tokens`` tokens
    long (EOS suppressed until then)."""
    ids = tokenizer.encode(prompt)
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
    )
    return out[0, len(ids) :].tolist()


@dataclass(frozen=True)
class LoraCase:
    """One fused module of one step, as :func:`llmpool.engine.lora.ops.torch_lora_add` takes it.

    ``row_slots[t]`` is row ``t``'s slot, -1 for the base model; ``ranks[s]`` is the adapter's
    own rank in slot ``s``, the rest of its ``max_rank`` columns zero as the manager leaves them.
    """

    out: torch.Tensor  # [T, sum(out_j)]
    x: torch.Tensor  # [T, in]
    a: torch.Tensor  # [S, parts * R, in]
    b: list[torch.Tensor]  # [S, out_j, R] per part
    offsets: list[int]
    scaling: torch.Tensor  # [S] float32
    batch: LoraBatch
    row_slots: list[int]
    ranks: list[int]

    @property
    def weights(self) -> LoraWeights:
        return LoraWeights(self.a, self.b, self.offsets)

    def weights_as_the_manager_lays_them_out(self) -> LoraWeights:
        """B in the manager's ``[out_j, S, R]`` memory, as the CPU kernel takes it."""
        b = [b_j.permute(1, 0, 2).contiguous().permute(1, 0, 2) for b_j in self.b]
        return LoraWeights(self.a, b, self.offsets)


# (slot, rows) in the batch's order: not sorted by slot; slot 1 is loaded but no row uses it.
LORA_GROUPS = [(2, 1), (0, 17), (3, 5)]
LORA_BASE_ROWS = 7


@pytest.fixture(scope="session")
def lora_case() -> Callable[..., LoraCase]:
    """Builds a case with ``in_features`` 48 (not a multiple of a kernel's block), parts of
    32, 16 and 16 outputs unless told, and adapters of rank ``max_rank`` but the one in slot 2
    (half)."""

    def build(
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        in_features: int = 48,
        out_parts: tuple[int, ...] = (32, 16, 16),
    ) -> LoraCase:
        generator = torch.Generator().manual_seed(max_rank)
        num_slots = 4
        ranks = [max_rank, max_rank, max_rank // 2, max_rank]
        slots = [slot for slot, rows in LORA_GROUPS for _ in range(rows)]
        num_rows = len(slots) + LORA_BASE_ROWS
        row_of = torch.randperm(num_rows, generator=generator).tolist()
        row_slots = [-1] * num_rows
        for place, slot in enumerate(slots):
            row_slots[row_of[place]] = slot
        sizes = torch.tensor([rows for _, rows in LORA_GROUPS])
        batch = LoraBatch(
            token_slots=torch.tensor(row_slots, device=device),
            sorted_tokens=torch.tensor(row_of[: len(slots)], device=device),
            group_slots=torch.tensor([slot for slot, _ in LORA_GROUPS], device=device),
            group_starts=torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).to(device),
            max_group_len=int(sizes.max()),
        )
        rank_mask = (torch.arange(max_rank)[None, :] < torch.tensor(ranks)[:, None]).float()
        a = torch.randn(num_slots, len(out_parts), max_rank, in_features, generator=generator)
        a = (0.2 * a * rank_mask[:, None, :, None]).view(num_slots, -1, in_features)
        b = [
            0.2 * torch.randn(num_slots, n, max_rank, generator=generator) * rank_mask[:, None]
            for n in out_parts
        ]
        offsets = torch.tensor([0, *out_parts]).cumsum(0)[:-1].tolist()

        def on_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype=dtype, device=device)

        return LoraCase(
            out=on_device(torch.randn(num_rows, sum(out_parts), generator=generator)),
            x=on_device(torch.randn(num_rows, in_features, generator=generator)),
            a=on_device(a),
            b=[on_device(b_j) for b_j in b],
            offsets=offsets,
            scaling=torch.tensor([2.0, 0.5, 4.0, 0.25], device=device),
            batch=batch,
            row_slots=row_slots,
            ranks=ranks,
        )

    return build
