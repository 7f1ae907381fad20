"""The bounds on what one request may ask of an engine pod, in one place.

Each bound keeps what a single request can make the server hold or compute small and known in
advance (the body itself is capped at 16 MiB in ``http.py``); a request beyond one is a 400
naming the field and the bound. OpenAI's own limits are used where it documents one.
"""

from __future__ import annotations

from typing import Any

MAX_N = 128  # choices per prompt; each one is a sequence in the engine
MAX_PROMPTS = 128  # prompts in one completions request; each one runs n sequences
MAX_LOGPROBS = 20  # logprobs (completions) and top_logprobs (chat), OpenAI's bound
MAX_STOP_STRINGS = 16  # checked against every new token's text of every choice
MAX_STOP_CHARS = 1024  # one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # entries; OpenAI's bound
MAX_MESSAGES = 2048  # OpenAI's bound
MAX_CONTENT_PARTS = 256  # text parts of one message
MAX_TOOLS = 128  # OpenAI's bound
MAX_TOOL_CALLS = 128  # calls in one assistant message
# Arrays and objects nested in a body. Far above what a valid request needs (a tool's schema may
# nest MAX_SCHEMA_DEPTH levels under four of the body's own), far below what would overflow a
# recursive walk (a chat template's ``tojson``, ``copy.deepcopy``) of the parsed body.
MAX_JSON_DEPTH = 64
# Fields this server does not read (``user``, ``metadata``, other servers' extensions) are
# accepted, as OpenAI clients send them; together they may hold this much JSON.
MAX_UNKNOWN_FIELDS_BYTES = 64 * 1024
# Token entries a non-streamed response may hold: each choice's tokens, each with its top
# logprobs. 2**19 is n=64 choices of 8,192 tokens, or 3 of 8,192 tokens with 20 top_logprobs.
# A chat response of 2**20 entries with 20 top_logprobs took 15 s of Python to build and 560 MiB
# at its peak (83 MiB of JSON), so this bound keeps one request near 280 MiB.
# ``llmpool serve --max-response-tokens`` sets it.
DEFAULT_MAX_RESPONSE_TOKENS = 2**19
# A stream holds one token's entries at a time, so it may carry this many times as many: the
# bound is then on the engine and event-loop work one request can claim, not on memory.
STREAMED_RESPONSE_FACTOR = 16


def nesting_depth(value: Any, cap: int) -> int:
    """How deeply arrays and objects nest in ``value`` (1 for a flat one, 0 for a scalar),
    walked without recursion; once past ``cap`` it stops looking, so the answer is then
    ``cap + 1``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        if depth > cap:
            return deepest
        stack.extend((child, depth + 1) for child in node if isinstance(child, dict | list))
    return deepest
