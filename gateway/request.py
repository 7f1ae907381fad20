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
from llmpool.protocol.requests import output_limit

# A body's tokens are estimated from its size: about four bytes of JSON text per token of
# prompt (an over-estimate for anything but plain English, which is the safe side).
BYTES_PER_TOKEN = 4
# Reserved per choice for a chat request that sets no limit (the engine then runs until EOS or
# the context is full, which the gateway does not know): settled against the usage returned.
UNSAID_CHAT_MAX_TOKENS = 1024
ROUTES = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
}


def prompt_estimate(body_bytes: int) -> int:
    """The prompt tokens a body of ``body_bytes`` is counted for before its usage is known."""
    return math.ceil(body_bytes / BYTES_PER_TOKEN)


@dataclass(frozen=True)
class RequestFacts:
    model: str
    priority: Any  # the body's priority field, as given (routing.requested_class reads it)
    prefix_key: bytes  # routing.prefix_key of the raw prompt
    choices: int  # n, times the prompts of a batch completion
    max_tokens: int  # per choice: the engine's own limit (output_limit), or the chat reservation
    body_bytes: int
    # A stream the client did not ask usage of: asked upstream, and the usage chunk kept from
    # the client. (A stream_options the engine would refuse is left for it to refuse.)
    forces_usage: bool = False
    # A Responses request continuing a stored response: the replica holding it must answer.
    previous_response_id: str | None = None

    @property
    def cost(self) -> int:
        """Tokens reserved against a tenant's tokens per minute at admission: the prompt
        estimated from the body's size plus every token every choice may generate."""
        return prompt_estimate(self.body_bytes) + self.choices * self.max_tokens


def read_facts(raw: bytes, path: str, prefix_chars: int) -> RequestFacts:
    body = parse_json_body(raw)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("model must be a string naming a served model", param="model")
    n = _count("n", body.get("n"), 1)
    prompts = body.get("prompt")
    batch = len(prompts) if isinstance(prompts, list) and _is_batch(prompts) else 1
    route = ROUTES[path]
    limit = output_limit(body, route)
    options = body.get("stream_options")
    # A Responses stream always ends with its usage (response.completed): nothing to ask.
    asked_no_usage = route != "responses" and (
        options is None
        or (isinstance(options, dict) and options.get("include_usage") in (None, False))
    )
    return RequestFacts(
        model=model,
        priority=body.get("priority"),
        prefix_key=routing.prefix_key(routing.prompt_text(body), prefix_chars),
        choices=n * batch,
        max_tokens=limit.max_tokens or limit.default or UNSAID_CHAT_MAX_TOKENS,
        body_bytes=len(raw),
        forces_usage=body.get("stream") is True and asked_no_usage,
        previous_response_id=_previous_response_id(body) if route == "responses" else None,
    )


def _previous_response_id(body: dict[str, Any]) -> str | None:
    value = body.get("previous_response_id")
    if value is not None and not isinstance(value, str):
        raise bad_request(
            "previous_response_id must be a string naming a stored response",
            param="previous_response_id",
        )
    return value


def upstream_body(raw: bytes, model: str, force_usage: bool) -> bytes:
    """The body with ``model`` as its model (an engine knows its served name, not the
    ``namespace/servedName`` a caller may qualify it with) and, with ``force_usage``, its stream
    asked for the usage chunk that settles the tenant's tokens."""
    body = parse_json_body(raw)
    body["model"] = model
    if force_usage:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
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
