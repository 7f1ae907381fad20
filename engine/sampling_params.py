"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmpool.engine.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

# torch.Generator.manual_seed takes any value in [-2**63, 2**64); negative ones wrap around.
SEED_RANGE = (-(2**63), 2**64 - 1)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's bounds; -100 bans a token, 100 all but forces it


@dataclass
class SamplingParams:
    """Per-request sampling settings; ``temperature == 0`` (or below 1e-5, as in vLLM) is greedy.

    Validation happens here, where the numbers are known, so that a bad request is refused
    before it reaches the engine loop.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = (
        None  # number of top logprobs per generated token, besides the chosen one
    )
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # The output must match this grammar: tokens it does not allow are masked at sampling, and
    # the request stops when the grammar is complete.
    structured_outputs: StructuredOutputsParams | None = None
    # Built once from the lists above and shared by every choice's copy (``for_choice``), so
    # that neither admission nor the scheduler and sampler at each step walk the lists again.
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)
    logit_bias_ids: torch.Tensor = field(init=False, repr=False, compare=False)
    logit_bias_values: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.stop_token_set = frozenset(self.stop_token_ids)
        # Imported here: the gateway imports this module (through the server's protocol) and
        # must not load torch. A few hundred entries at most: too small for torch to start a
        # parallel region (and an OpenMP team) on the thread that builds the params.
        import torch

        self.logit_bias_ids = torch.tensor(list(self.logit_bias), dtype=torch.int64)
        self.logit_bias_values = torch.tensor(list(self.logit_bias.values()), dtype=torch.float32)

    def for_choice(self, index: int) -> SamplingParams:
        """The params of choice ``index`` of ``n``: one sequence, seed + index when seeded. A
        shallow copy, so the lists and what was built from them are shared, not checked again."""
        choice = copy.copy(self)
        choice.n = 1
        if self.seed is not None:
            choice.seed = self.seed + index
        return choice

    def _validate(self) -> None:
        numbers = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")
        for name in (*numbers, "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        low, high = LOGIT_BIAS_RANGE
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disabled) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be between 0 and 20, got {self.logprobs}",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (
                self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1] - (self.n - 1),
                f"seed must be a 64-bit integer, between {SEED_RANGE[0]} and {SEED_RANGE[1]}"
                " less n - 1 (choice i uses seed + i)",
            ),
            (
                all(token >= 0 for token in self.stop_token_ids),
                "stop_token_ids must be non-negative token ids",
            ),
            (
                all(token >= 0 for token in self.logit_bias),
                "logit_bias keys must be non-negative token ids",
            ),
            (
                all(low <= bias <= high for bias in self.logit_bias.values()),
                f"logit_bias values must be between {low:g} and {high:g}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and the softmax to NaN.
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
