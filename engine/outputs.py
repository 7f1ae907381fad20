"""What the engine hands back: per-step deltas, and the whole results the offline API returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestDelta:
    """What one step added to one request (the unit the async server streams)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # what failed the request when finish_reason is "error"
    error_code: str | None = None  # set when the request's own input failed it (a 4xx, not 500)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
