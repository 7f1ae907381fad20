"""SpeculativeConfig: vLLM's ``--speculative-config`` JSON, checked at start."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
# Bounds that keep a step's extra rows and the proposer's work small.
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup speculation (vLLM's ``ngram`` method).

    ``disable_by_batch_size``: no drafts in a step while this many requests or more are
    running (vLLM V0's name); there the batch already keeps the CPU busy, and rows spent on
    drafts that may be rejected cost more than they save. None: speculate at every size. The
    default, 16: at 16 requests speculation lost on code edits (0.80x tok/s) while it won on
    extraction (1.97x), and won 1.7-1.9x at one request (benchmarks/README.md).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS, f"method must be one of {', '.join(METHODS)}"),
            (
                _is_int(self.num_speculative_tokens)
                and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}",
            ),
            (
                _is_int(self.prompt_lookup_min)
                and _is_int(self.prompt_lookup_max)
                and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP,
                f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max <= {MAX_PROMPT_LOOKUP}",
            ),
            (
                self.disable_by_batch_size is None
                or (_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
                "disable_by_batch_size must be a positive integer or null",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"speculative_config: {message}, got {self._values()}")

    def _values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From the JSON text of the flag, a dict (the offline API) or a config already made."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {', '.join(unknown)}")
        return cls(**value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
