"""OpenAI request bodies: read and type-checked into requests, or refused as OpenAI does."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from llmpool.protocol.errors import bad_request
from llmpool.protocol.limits import (
    MAX_CONTENT_PARTS,
    MAX_JSON_DEPTH,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOL_CALLS,
    MAX_UNKNOWN_FIELDS_BYTES,
    STREAMED_RESPONSE_FACTOR,
    nesting_depth,
)
from llmpool.protocol.priority import PRIORITY_CLASSES
from llmpool.protocol.tool_messages import check_tool_replies

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI fields this server does not implement: refused by name rather than silently ignored.
# A value that asks for nothing (null, false, empty) is accepted.
UNSUPPORTED_FIELDS = ("functions", "function_call", "suffix", "echo")
COMPLETION_ONLY_UNSUPPORTED = ("tools", "tool_choice", "parallel_tool_calls")  # chat-only fields
LEGACY_FUNCTION_FIELDS = {"functions": "tools", "function_call": "tool_choice"}
# Every field the parsers read (here and in the engine server's constraints.py); the others
# count as unknown.
COMMON_FIELDS = (
    "model", "n", "best_of", "stream", "stream_options", "stop", "stop_token_ids", "temperature",
    "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "min_tokens", "include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
    "logit_bias", "cache_salt", "priority", "max_tokens", "max_completion_tokens", "logprobs",
    "response_format", "structured_outputs", *UNSUPPORTED_FIELDS, *COMPLETION_ONLY_UNSUPPORTED,
)  # fmt: skip
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt")
CHAT_FIELDS = (*COMMON_FIELDS, "messages", "top_logprobs", "add_generation_prompt")
# The output-token limit's two names, each route's own first (``output_limit``).
MAX_TOKENS_FIELDS = {
    "completions": ("max_tokens", "max_completion_tokens"),
    "chat": ("max_completion_tokens", "max_tokens"),
    # The engine answers it as chat's max_completion_tokens (engine/server/responses_api.py).
    "responses": ("max_output_tokens",),
}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default on /v1/completions


def check_shape(body: dict[str, Any], known: tuple[str, ...]) -> None:
    """Nesting within MAX_JSON_DEPTH in every field, and unknown fields within
    MAX_UNKNOWN_FIELDS_BYTES together, so that a large body with a tiny prompt is refused."""
    for name, value in body.items():
        depth = nesting_depth(value, MAX_JSON_DEPTH - 1)
        if depth >= MAX_JSON_DEPTH:  # the body's own object is the first level
            raise bad_request(
                f"{name} nests arrays and objects too deeply: a request body may nest at most"
                f" {MAX_JSON_DEPTH} levels",
                param=name,
            )
    unknown = {name: len(json.dumps(body[name])) for name in body.keys() - set(known)}
    if sum(unknown.values()) > MAX_UNKNOWN_FIELDS_BYTES:
        largest = max(unknown, key=lambda name: unknown[name])
        raise bad_request(
            f"fields this server does not use ({', '.join(sorted(unknown))}) hold"
            f" {sum(unknown.values()):,} bytes of JSON; at most {MAX_UNKNOWN_FIELDS_BYTES:,} are"
            " accepted",
            param=largest,
        )


def check_count(value: list[Any] | dict[str, Any], bound: int, param: str, what: str) -> None:
    if len(value) > bound:
        raise bad_request(
            f"{param} has {len(value):,} {what}; at most {bound:,} are accepted", param=param
        )


class Fields:
    """Typed access to a JSON object's fields; a wrong type names the field in a 400."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def get(self, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        # bool is an int in Python but not in JSON; a float field takes ints.
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            expected = " or ".join(_JSON_NAMES[kind] for kind in kinds)
            raise bad_request(f"{name} must be {expected}, got {_json_type(value)}", param=name)
        return value

    def number(self, name: str, default: float) -> float:
        value = self.get(name, (int, float), default)
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise bad_request(f"{name} must be a finite number, got {value}", param=name)
        return number

    def integer(self, name: str, default: int | None) -> int | None:
        return self.get(name, (int,), default)


_JSON_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


def _json_type(value: Any) -> str:
    for kind, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    ):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def check_text(value: str, param: str) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``), which are not text the tokenizer can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param} is not valid Unicode (lone surrogate)", param=param) from None
    return value


@dataclass
class GenerationRequest:
    """What completions and chat requests share: the model, choices, streaming and sampling."""

    model: str | None
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None  # as the client asked; None: not given
    max_tokens_param: str  # the field max_tokens came from (chat has two names for it)
    default_max_tokens: int | None  # when not given; None: until EOS or the context is full
    logprobs: int | None  # top alternatives per token; None: no logprobs
    priority: int | None = None  # None: the engine's --priority-class
    cache_salt: str | None = None  # keeps this request's prefix-cache blocks apart
    sampling: dict[str, Any] = field(default_factory=dict)

    def check_response_size(self, max_tokens_per_prompt: list[int], limit: int) -> None:
        """Refuse an answer that could hold more than ``limit`` token entries (``n`` choices of
        each prompt's max tokens, each token with its top logprobs): a response not streamed is
        built whole in memory. A stream holds one event at a time and may carry
        STREAMED_RESPONSE_FACTOR times as many."""
        if self.stream:
            limit *= STREAMED_RESPONSE_FACTOR
        completion_tokens = sum(max_tokens_per_prompt)
        top = self.logprobs or 0
        entries = self.n * completion_tokens * (1 + top)
        if entries <= limit:
            return
        tokens = f"{completion_tokens:,} tokens"
        if len(max_tokens_per_prompt) > 1:
            tokens += f" over {len(max_tokens_per_prompt)} prompts"
        if self.max_tokens is None:
            tokens += f" (the room left in the context, as {self.max_tokens_param} is not set)"
        kind = "a streamed response" if self.stream else "a response that is not streamed"
        raise bad_request(
            f"this request could return n={self.n} × {tokens} × (1 + {top} top logprobs) ="
            f" {entries:,} token entries; {kind} may hold at most {limit:,}: lower n,"
            f" {self.max_tokens_param} or the logprobs asked for"
            + ("" if self.stream else ", or stream the response"),
            param=self.max_tokens_param,
        )


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]] = field(default_factory=list)


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class OutputLimit:
    """How many tokens each choice of a request may generate, as the request says."""

    max_tokens: int | None  # as asked; None: neither field given
    param: str  # the field it came from; the route's own name for it when neither is given
    default: int | None  # applies when not given; None: until EOS or the context is full


def output_limit(body: dict[str, Any], route: str) -> OutputLimit:
    """The output-token limit of a ``route`` ("completions", "chat" or "responses") request:
    the one rule that the engine generates by and the gateway counts by, so that the two always
    agree.

    Both routes read both fields, OpenAI's way: chat's own name is ``max_completion_tokens``
    (``max_tokens`` its deprecated alias), completions' is ``max_tokens``. Given both, they
    must be equal: two different limits in one request is a 400 naming the alias, as no reading
    of it would be the client's for sure. Neither given: 16 on completions (OpenAI's default),
    none on chat (until EOS or the end of the context). The Responses API has one name,
    ``max_output_tokens``, and chat's default.
    """
    fields = Fields(body)
    given: dict[str, int] = {}
    for name in MAX_TOKENS_FIELDS[route]:
        value = fields.integer(name, None)
        if value is None:
            continue
        if value < 1:
            raise bad_request(f"{name} must be at least 1, got {value}", param=name)
        given[name] = value
    own, *aliases = MAX_TOKENS_FIELDS[route]
    default = COMPLETIONS_DEFAULT_MAX_TOKENS if route == "completions" else None
    if not given:
        return OutputLimit(None, own, default)
    if len(set(given.values())) > 1:
        alias = aliases[0]
        raise bad_request(
            f"{own} ({given[own]:,}) and {alias} ({given[alias]:,}) are two names for one limit"
            f" and differ; send {own} alone",
            param=alias,
        )
    name = own if own in given else aliases[0]
    return OutputLimit(given[name], name, default)


def _common(fields: Fields, route: str) -> dict[str, Any]:
    n: int = fields.get("n", (int,), 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", param="n")
    best_of = fields.integer("best_of", None)
    if best_of is not None and best_of != n:
        raise bad_request("best_of is not supported by this server (only equal to n)", "best_of")
    limit = output_limit(fields.body, route)
    stream_options = fields.get("stream_options", (dict,), {})
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage must be a boolean", param="stream_options")
    stop = _stop(fields.get("stop", (str, list), []))
    stop_token_ids = fields.get("stop_token_ids", (list,), [])
    check_count(stop_token_ids, MAX_STOP_TOKEN_IDS, "stop_token_ids", "entries")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
        raise bad_request("stop_token_ids must be an array of integers", param="stop_token_ids")
    sampling = {
        "temperature": fields.number("temperature", 1.0),
        "top_p": fields.number("top_p", 1.0),
        "top_k": fields.integer("top_k", 0),
        "min_p": fields.number("min_p", 0.0),
        "presence_penalty": fields.number("presence_penalty", 0.0),
        "frequency_penalty": fields.number("frequency_penalty", 0.0),
        "repetition_penalty": fields.number("repetition_penalty", 1.0),
        "seed": fields.integer("seed", None),
        "min_tokens": fields.integer("min_tokens", 0),
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "include_stop_str_in_output": fields.get("include_stop_str_in_output", (bool,), False),
        "ignore_eos": fields.get("ignore_eos", (bool,), False),
        "skip_special_tokens": fields.get("skip_special_tokens", (bool,), True),
        "logit_bias": _logit_bias(fields.get("logit_bias", (dict,), {})),
    }
    cache_salt = fields.get("cache_salt", (str,))
    return {
        "model": fields.get("model", (str,)),
        "priority": _priority(fields.get("priority", (int, str))),
        "cache_salt": None if cache_salt is None else check_text(cache_salt, "cache_salt"),
        "n": n,
        "stream": fields.get("stream", (bool,), False),
        "include_usage": include_usage,
        "max_tokens": limit.max_tokens,
        "max_tokens_param": limit.param,
        "default_max_tokens": limit.default,
        "sampling": sampling,
    }


def _refuse_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name) in (None, False, "", [], {}):
            continue
        if name in LEGACY_FUNCTION_FIELDS:
            raise bad_request(
                f"{name} is the deprecated form of {LEGACY_FUNCTION_FIELDS[name]}; send"
                f" {LEGACY_FUNCTION_FIELDS[name]} instead",
                param=name,
            )
        raise bad_request(f"{name} is not supported by this server", param=name)


def _stop(value: str | list[Any]) -> list[str]:
    stop = [value] if isinstance(value, str) else value
    check_count(stop, MAX_STOP_STRINGS, "stop", "strings")
    for text in stop:
        if not isinstance(text, str):
            raise bad_request("stop must be a string or an array of strings", param="stop")
        if len(text) > MAX_STOP_CHARS:
            raise bad_request(
                f"stop strings may have at most {MAX_STOP_CHARS:,} characters, got one of"
                f" {len(text):,}",
                param="stop",
            )
        check_text(text, "stop")
    return stop


def _logit_bias(value: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}``; the ids are checked against the vocabulary at admission."""
    check_count(value, MAX_LOGIT_BIAS, "logit_bias", "entries")
    bias = {}
    for key, amount in value.items():
        if not key.isascii() or not key.isdigit() or len(key) > 18:
            raise bad_request(
                f"logit_bias keys must be token ids written as decimal strings, got {key!r}",
                param="logit_bias",
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise bad_request("logit_bias values must be numbers", param="logit_bias")
        if not -100 <= amount <= 100:  # also refuses NaN
            raise bad_request(
                f"logit_bias values must be between -100 and 100, got {amount}", param="logit_bias"
            )
        bias[int(key)] = float(amount)
    return bias


def _priority(value: int | str | None) -> int | None:
    """vLLM's integer priority (lower runs first), or a priority class by name."""
    if isinstance(value, str):
        if value not in PRIORITY_CLASSES:
            raise bad_request(
                f"priority must be an integer or one of {', '.join(PRIORITY_CLASSES)}, got {value!r}",
                param="priority",
            )
        return PRIORITY_CLASSES[value]
    return value


def _logprobs_count(value: int | None, param: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}", param=param)
    return value


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    check_shape(body, COMPLETION_FIELDS)
    _refuse_unsupported(body, UNSUPPORTED_FIELDS + COMPLETION_ONLY_UNSUPPORTED)
    fields = Fields(body)
    return CompletionRequest(
        **_common(fields, "completions"),
        logprobs=_logprobs_count(fields.integer("logprobs", None), "logprobs"),
        prompts=_parse_prompts(body.get("prompt")),
    )


def _parse_prompts(prompt: Any) -> list[str | list[int]]:
    """A prompt is text, token ids, or a non-empty array of either."""

    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        )

    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        check_count(prompt, MAX_PROMPTS, "prompt", "prompts")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif is_ids(prompt) and prompt:
        prompts = [prompt]
    elif (
        isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt)
    ):
        prompts = prompt
    else:
        raise bad_request(
            "prompt must be a string, an array of strings, an array of token ids or an array of"
            " token id arrays",
            param="prompt",
        )
    for p in prompts:
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(p, str):
            check_text(p, "prompt")
    return prompts


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    check_shape(body, CHAT_FIELDS)
    _refuse_unsupported(body, UNSUPPORTED_FIELDS)
    fields = Fields(body)
    wants_logprobs = fields.get("logprobs", (bool,), False)
    top_logprobs = _logprobs_count(fields.integer("top_logprobs", None), "top_logprobs")
    if top_logprobs is not None and not wants_logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    return ChatRequest(
        **_common(fields, "chat"),
        logprobs=(top_logprobs or 0) if wants_logprobs else None,
        messages=_parse_messages(body.get("messages")),
        add_generation_prompt=fields.get("add_generation_prompt", (bool,), True),
    )


def _parse_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", param="messages")
    check_count(messages, MAX_MESSAGES, "messages", "messages")
    parsed = []
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object", param=param)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                param=f"{param}.role",
            )
        parsed.append(
            {
                **message,
                "content": _message_text(message.get("content"), f"{param}.content"),
                **_tool_fields(message, role, param),
            }
        )
    check_tool_replies(parsed)
    return parsed


def _tool_fields(message: dict[str, Any], role: str, param: str) -> dict[str, Any]:
    """An assistant's ``tool_calls`` and a tool result's ``tool_call_id``, checked."""
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(
                f"{param}.tool_call_id must be the id of the call this message answers",
                param=f"{param}.tool_call_id",
            )
        return {"tool_call_id": check_text(call_id, f"{param}.tool_call_id")}
    calls = message.get("tool_calls")
    if calls is None:
        return {}
    where = f"{param}.tool_calls"
    if role != "assistant" or not isinstance(calls, list):
        raise bad_request(f"{where} must be an array on an assistant message", param=where)
    check_count(calls, MAX_TOOL_CALLS, where, "calls")
    checked = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
            or not isinstance(call.get("id", ""), str)
        ):
            raise bad_request(
                f'{where} items must be {{"id", "type": "function", "function": {{"name",'
                ' "arguments": a JSON string}}',
                param=where,
            )
        checked.append(
            {
                "id": check_text(call.get("id", ""), where),
                "type": "function",
                "function": {
                    "name": check_text(function["name"], where),
                    "arguments": check_text(function["arguments"], where),
                },
            }
        )
    return {"tool_calls": checked}


def _message_text(content: Any, param: str) -> str:
    """Content is text or an array of text parts (other part types need a multimodal model)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return check_text(content, param)
    if isinstance(content, list):
        check_count(content, MAX_CONTENT_PARTS, param, "parts")
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    f'{param} parts must be {{"type": "text", "text": ...}}', param=param
                )
            texts.append(check_text(part["text"], param))
        return "".join(texts)
    raise bad_request(f"{param} must be a string or an array of text parts", param=param)
