"""A Responses API body (``POST /v1/responses``) read into the chat body the chat route serves.

The Responses API is served on the chat path: ``input`` items and ``instructions`` become chat
messages, flat function tools become chat tools, ``text.format`` becomes ``response_format`` and
``max_output_tokens`` becomes ``max_completion_tokens``, so templating, tools, grammars, bounds
and sampling are the chat route's own. What is checked here names the Responses field
(``input[2].call_id``); what the chat path refuses is renamed to it (``renamed``).

Documented choices: ``reasoning`` is accepted and ignored (the models served do not reason apart
from their answer), ``reasoning`` input items are left out of the prompt, and ``include`` takes
only ``reasoning.encrypted_content`` (there is never reasoning to include); any other value is a
400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmpool.protocol.errors import APIError, bad_request
from llmpool.protocol.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOL_CALLS, MAX_TOOLS
from llmpool.protocol.requests import Fields, check_count, check_shape, check_text

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
INCLUDABLE = ("reasoning.encrypted_content",)
# Sampling fields of the chat route (vLLM's extensions) that a Responses body may carry too.
CHAT_EXTENSIONS = (
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "priority", "cache_salt", "logit_bias",
)  # fmt: skip
RESPONSES_FIELDS = (
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
    "reasoning", "include", "metadata", "user", "truncation", "background", "service_tier",
    "prompt_cache_key", "safety_identifier", *CHAT_EXTENSIONS,
)  # fmt: skip
# OpenAI's bounds on metadata.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Chat fields and the Responses fields they came from, for the errors the chat path raises.
RENAMED_PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


@dataclass
class ResponsesRequest:
    """What a Responses body asks beyond its chat body: what the response object echoes, and
    what the server keeps (``store``) or continues (``previous_response_id``)."""

    model: str | None
    stream: bool
    store: bool
    previous_response_id: str | None
    messages: list[dict[str, Any]]  # the chat messages of ``input`` alone (no instructions)
    echo: dict[str, Any] = field(default_factory=dict)  # fields the response object repeats


def previous_response_id(body: dict[str, Any]) -> str | None:
    value = Fields(body).get("previous_response_id", (str,))
    return None if value is None else check_text(value, "previous_response_id")


def parse_responses_request(
    body: dict[str, Any], history: list[dict[str, Any]]
) -> tuple[ResponsesRequest, dict[str, Any]]:
    """The request and its chat body; ``history`` is the conversation of the response that
    ``previous_response_id`` names (chat messages), empty without one."""
    check_shape(body, RESPONSES_FIELDS)
    fields = Fields(body)
    _refuse(fields)
    messages = input_messages(body.get("input"))
    instructions = fields.get("instructions", (str,))
    system = [] if not instructions else [{"role": "system", "content": instructions}]
    check_text(instructions or "", "instructions")
    if len(history) + len(messages) > MAX_MESSAGES:
        raise bad_request(
            f"the conversation (previous_response_id's {len(history):,} messages and input's"
            f" {len(messages):,}) has more than {MAX_MESSAGES:,} messages",
            param="input",
        )
    chat: dict[str, Any] = {
        name: body[name] for name in ("model", "temperature", "top_p", "stream") if name in body
    }
    chat.update({name: body[name] for name in CHAT_EXTENSIONS if name in body})
    chat["messages"] = [*system, *history, *messages]
    tools = _tools(fields.get("tools", (list,), []))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    text = fields.get("text", (dict,), {})
    text_format = text.get("format")
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    request = ResponsesRequest(
        model=fields.get("model", (str,)),
        stream=fields.get("stream", (bool,), False),
        store=fields.get("store", (bool,), True),
        previous_response_id=previous_response_id(body),
        messages=messages,
        echo={
            "instructions": instructions,
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "max_output_tokens": body.get("max_output_tokens"),
            "text": {"format": text_format or {"type": "text"}},
            "metadata": _metadata(fields.get("metadata", (dict,), {})),
            "user": fields.get("user", (str,)),
            "reasoning": {"effort": None, "summary": None},
            "truncation": "disabled",
        },
    )
    return request, chat


def renamed(error: APIError) -> APIError:
    """An error of the chat path named by the Responses field it came from."""
    if error.param is None:
        return error
    if error.param.startswith("messages"):  # its index counts instructions and history too
        error.param = "input"
    for chat_name, name in RENAMED_PARAMS.items():
        if error.param == chat_name or error.param.startswith(f"{chat_name}["):
            error.param = name + error.param[len(chat_name) :]
            error.message = error.message.replace(chat_name, name)
            error.args = (error.message,)
    return error


def _refuse(fields: Fields) -> None:
    """Fields that ask for what this server does not do: a 400 naming them."""
    if fields.get("background", (bool,), False):
        raise bad_request("background responses are not supported by this server", "background")
    truncation = fields.get("truncation", (str,), "disabled")
    if truncation != "disabled":
        raise bad_request(
            f"truncation {truncation!r} is not supported by this server; it takes disabled",
            param="truncation",
        )
    fields.get("reasoning", (dict,))  # accepted and ignored (module docstring)
    include = fields.get("include", (list,), [])
    check_count(include, len(INCLUDABLE), "include", "values")
    for index, value in enumerate(include):
        if value not in INCLUDABLE:
            raise bad_request(
                f"include[{index}] {value!r} is not supported by this server; it takes"
                f" {', '.join(INCLUDABLE)}",
                param=f"include[{index}]",
            )


def _metadata(value: dict[str, Any]) -> dict[str, str]:
    check_count(value, MAX_METADATA_KEYS, "metadata", "keys")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(
                f"metadata keys may have at most {MAX_METADATA_KEY_CHARS} characters",
                param="metadata",
            )
        if not isinstance(text, str) or len(text) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(
                f"metadata[{key!r}] must be a string of at most {MAX_METADATA_VALUE_CHARS}"
                " characters",
                param="metadata",
            )
        check_text(key + text, "metadata")
    return value


# --- input ------------------------------------------------------------------------------------


def input_messages(value: Any, param: str = "input") -> list[dict[str, Any]]:
    """``input`` (text, or message, ``function_call`` and ``function_call_output`` items) as
    chat messages; the calls that follow an assistant message join it, as chat writes them."""
    if isinstance(value, str):
        return [{"role": "user", "content": check_text(value, param)}]
    if not isinstance(value, list) or not value:
        raise bad_request(f"{param} must be a string or a non-empty array of items", param=param)
    check_count(value, MAX_MESSAGES, param, "items")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = _content(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":  # reasoning items: left out of the prompt (module docstring)
            raise bad_request(
                f"{where}.type must be message, function_call, function_call_output or"
                f" reasoning, got {kind!r}",
                param=f"{where}.type",
            )
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise bad_request(
            f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}",
            param=f"{where}.role",
        )
    return {"role": role, "content": _content(item.get("content"), f"{where}.content")}


def _content(value: Any, where: str) -> str:
    """Text, or an array of ``input_text`` / ``output_text`` parts."""
    if isinstance(value, str):
        return check_text(value, where)
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a string or an array of text parts", param=where)
    check_count(value, MAX_CONTENT_PARTS, where, "parts")
    texts = []
    for index, part in enumerate(value):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(
                f"{at}.type must be input_text or output_text (this server serves a text model),"
                f" got {kind!r}",
                param=f"{at}.type",
            )
        texts.append(_string(part, "text", at, empty=True))
    return "".join(texts)


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    call = {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {
            "name": _string(item, "name", where),
            "arguments": _string(item, "arguments", where, empty=True),
        },
    }
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    calls = last.setdefault("tool_calls", [])
    if len(calls) == MAX_TOOL_CALLS:
        raise bad_request(
            f"{where} is call {MAX_TOOL_CALLS + 1:,} of one assistant turn; at most"
            f" {MAX_TOOL_CALLS:,} are accepted",
            param=where,
        )
    calls.append(call)


def _string(item: dict[str, Any], key: str, where: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not (value or empty):
        kind = "a string" if empty else "a non-empty string"
        raise bad_request(f"{where}.{key} must be {kind}", param=f"{where}.{key}")
    return check_text(value, f"{where}.{key}")


# --- tools and formats ----------------------------------------------------------------------------


def _tools(value: list[Any]) -> list[dict[str, Any]]:
    """Responses' flat function tools in chat's shape (which the chat path then checks)."""
    check_count(value, MAX_TOOLS, "tools", "tools")
    tools = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(
                f"{where}.type must be function (this server runs no hosted tools), got {kind!r}",
                param=f"{where}.type",
            )
        function = {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool
        }
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    if isinstance(value, dict):
        raise bad_request(
            'tool_choice must be none, auto, required or {"type": "function", "name": ...}',
            param="tool_choice",
        )
    return value


def _response_format(value: Any) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``: json_schema's fields move into a
    ``json_schema`` object."""
    if not isinstance(value, dict):
        raise bad_request("text.format must be an object", param="text.format")
    if value.get("type") != "json_schema":
        return value
    spec = {key: value[key] for key in ("name", "schema", "strict", "description") if key in value}
    return {"type": "json_schema", "json_schema": spec}
