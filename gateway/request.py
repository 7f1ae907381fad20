"""What the gateway reads from a request body: the few facts routing and limits need.

The parsed body is dropped as soon as these are taken, so a request in flight costs its raw
bytes (which are forwarded) and nothing more.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from llmpool.gateway import routing
from llmpool.protocol.errors import bad_request, parse_json_body

# A body's tokens are estimated from its size: about four bytes of JSON text per token of
# prompt (an over-estimate for anything but plain English, which is the safe side).
BYTES_PER_TOKEN = 4
# When a body does not say max_tokens: the engine's own default for completions, and for chat
# (which runs until EOS or the context is full) a budget of this many tokens.
UNSAID_MAX_TOKENS = {"/v1/completions": 16, "/v1/chat/completions": 1024, "/v1/responses": 1024}


@dataclass(frozen=True)
class RequestFacts:
    model: str
    priority: Any  # the body's priority field, as given (routing.requested_class reads it)
    prefix_key: bytes  # routing.prefix_key of the raw prompt
    choices: int  # n, times the prompts of a batch completion
    max_tokens: int  # as asked, or UNSAID_MAX_TOKENS for the path
    body_bytes: int

    @property
    def cost(self) -> int:
        """Tokens counted against a tenant's tokens per minute, at admission: the prompt
        estimated from the body's size plus every token every choice may generate."""
        return math.ceil(self.body_bytes / BYTES_PER_TOKEN) + self.choices * self.max_tokens


def read_facts(raw: bytes, path: str, prefix_chars: int) -> RequestFacts:
    body = parse_json_body(raw)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("model must be a string naming a served model", param="model")
    n = _count("n", body.get("n"), 1)
    prompts = body.get("prompt")
    batch = len(prompts) if isinstance(prompts, list) and _is_batch(prompts) else 1
    asked = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _count(asked, body.get(asked), UNSAID_MAX_TOKENS[path])
    return RequestFacts(
        model=model,
        priority=body.get("priority"),
        prefix_key=routing.prefix_key(routing.prompt_text(body), prefix_chars),
        choices=n * batch,
        max_tokens=max_tokens,
        body_bytes=len(raw),
    )


def with_model(raw: bytes, model: str) -> bytes:
    """The body with ``model`` as its model: an engine knows its served name, not the
    ``namespace/servedName`` a caller may qualify it with."""
    body = parse_json_body(raw)
    body["model"] = model
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _is_batch(prompt: list[Any]) -> bool:
    """A list of prompts (texts or token lists), not one prompt of token ids."""
    return bool(prompt) and isinstance(prompt[0], str | list)


def _count(name: str, value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"{name} must be a non-negative integer, got {value!r}", param=name)
    return value
