"""NgramProposer: draft tokens looked up in the request's own tokens (prompt lookup).

Output that quotes its input (extraction, code edits, summaries that copy names) repeats n-grams
of the prompt: after the last ``n`` tokens occurred earlier, the tokens that followed them are a
good guess for what comes next, and the target model checks the guess in the same step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llmpool.engine.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to ``min(num_speculative_tokens, max_drafts)`` tokens that followed the most recent
        earlier occurrence of the longest suffix of ``token_ids`` (``max_n`` down to ``min_n``
        tokens); none when no such suffix occurred before.

        The work is ``max_n`` vectorized passes over the tokens: the loop is over n, never over
        positions.
        """
        limit = min(self.num_speculative_tokens, max_drafts)
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if limit <= 0 or length <= self.min_n:
            return []
        # match_len[i]: how many of the last tokens match the tokens ending at position i (< the
        # last position), counted up to max_n; each pass extends every live match by one.
        live = tokens[:-1] == tokens[-1]
        match_len = live.astype(np.int64)
        for back in range(1, min(self.max_n, length - 1)):
            extends = np.zeros_like(live)
            extends[back:] = tokens[: length - 1 - back] == tokens[length - 1 - back]
            live &= extends
            if not live.any():
                break
            match_len += live
        best = int(match_len.max())
        if best < self.min_n:
            return []
        end = int(np.flatnonzero(match_len == best)[-1])
        return tokens[end + 1 : end + 1 + limit].tolist()
