"""Incremental detokenization and stop strings for one request."""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded before the first output token, so that its leading space comes out right.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Yields the text each new token adds, holding back bytes of an unfinished character."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop: bool,
        skip_special: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        # Longest stop string minus one: text that may still turn out to start a stop string.
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0

    def add_token(self, token_id: int) -> str | None:
        """Append a token; returns the stop string that ended the text, if one did."""
        self.token_ids.append(token_id)
        skip = self.skip_special
        prefix = self.tokenizer.decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip
        )
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], skip_special_tokens=skip)
        # A trailing U+FFFD is half a character: wait for the token that completes it.
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
        return self._find_stop()

    def _find_stop(self) -> str | None:
        if not self.stop:
            return None
        search_from = max(0, self.emitted - self.hold_back)
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1:
                self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
                return stop
        return None

    def take_new_text(self, finished: bool) -> str:
        """The text not yet handed out; the tail that may begin a stop string waits unless finished."""
        if finished or not self.stop:
            end = len(self.text)
        else:
            end = max(self.emitted, len(self.text) - self.hold_back)
        new_text = self.text[self.emitted : end]
        self.emitted = end
        return new_text
