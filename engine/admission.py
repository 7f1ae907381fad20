"""Admission: what a request must satisfy against the loaded model before the engine queues it.

``SamplingParams`` checks what holds for any model (ranges, finiteness); this module checks what
depends on the model and the engine (vocabulary, context window, the priority bound). Together
they are the first line of "nothing a client sends may crash the engine loop": every value that
later indexes a tensor or fills an int64 is known to fit before the request is queued.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmpool.engine.sampling_params import SamplingParams
from llmpool.protocol.priority import PRIORITY_CLASSES

# Beyond the classes, vLLM-style integer priorities are allowed down to this (lower runs first).
LOWEST_PRIORITY = 2**31 - 1


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``param`` names the field, as OpenAI errors do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """A prompt that cannot fit the context window; the server answers 400 with these numbers."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="prompt")


@dataclass(frozen=True)
class Limits:
    vocab_size: int  # rows of the embedding: every token id must index one
    max_model_len: int
    priority_floor: int  # the most urgent priority a request may ask for


def admit(
    prompt_token_ids: list[int], params: SamplingParams, priority: int, limits: Limits
) -> SamplingParams:
    """Raise InvalidRequestError for what cannot run; return the params, top_k clipped to the
    vocabulary (a top_k beyond it means "no top-k", as in vLLM)."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if num_prompt >= limits.max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {limits.max_model_len:,} tokens; the prompt"
            f" has {num_prompt:,} tokens, leaving no room to generate"
        )
    vocab = limits.vocab_size
    if not all(0 <= token < vocab for token in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    # SamplingParams refused negative ids; the largest is enough (and shared by the choices).
    if max(params.stop_token_set, default=0) >= vocab:
        raise InvalidRequestError(
            f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids"
        )
    if params.logit_bias and int(params.logit_bias_ids.max()) >= vocab:
        raise InvalidRequestError(
            f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias"
        )
    if not limits.priority_floor <= priority <= LOWEST_PRIORITY:
        raise InvalidRequestError(
            f"priority must be between {limits.priority_floor} ({_class_name(limits.priority_floor)},"
            f" the most urgent class this server accepts) and {LOWEST_PRIORITY}, got {priority}",
            param="priority",
        )
    if params.top_k > vocab:
        return replace(params, top_k=0)
    return params


def _class_name(priority: int) -> str:
    return next(name for name, value in PRIORITY_CLASSES.items() if value == priority)
