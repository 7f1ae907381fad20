"""DraftBackoff: a request whose drafts keep being rejected stops drafting for a while.

A drafted step verifies ``1 + k`` rows of the request instead of one (and on CPU its attention
leaves the one-token decode kernel), so drafts that are all rejected make the step dearer for
nothing. Text that does not quote its context (the random-words workload of
``benchmarks/spec_decode.py``: 11% acceptance at one request, 0.72x tok/s) drafts from chance
n-gram matches. After ``MISSES_BEFORE_PAUSE`` drafted steps in a row with no draft accepted, the
request skips drafting for 2, then 4, 8, ... output tokens (at most ``MAX_PAUSE_TOKENS``); one
accepted draft resets it. Drafts never change what a request gets, so neither does this.
"""

from __future__ import annotations

from dataclasses import dataclass

MISSES_BEFORE_PAUSE = 2
MAX_PAUSE_TOKENS = 64


@dataclass
class DraftBackoff:
    misses: int = 0  # drafted steps in a row with no draft accepted
    resume_at: int = 0  # the output length from which drafts are proposed again

    def allows(self, num_output_tokens: int) -> bool:
        return num_output_tokens >= self.resume_at

    def record(self, num_accepted: int, num_output_tokens: int) -> None:
        """One drafted step's outcome, ``num_output_tokens`` counted after it."""
        if num_accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            pause = min(2 ** (self.misses - MISSES_BEFORE_PAUSE + 1), MAX_PAUSE_TOKENS)
            self.resume_at = num_output_tokens + pause
