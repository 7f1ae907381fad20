"""Tool calling: the tools a request offers as grammar and prompt, and model output as ``tool_calls``.

Three ways a call comes out, as in vLLM. A named ``tool_choice`` constrains the output to the
function's ``parameters`` schema and the whole output is the call's arguments. ``required``
constrains it to a JSON array of ``{"name", "parameters"}`` objects, one ``anyOf`` branch per
tool. ``auto`` leaves the model free and parses its own call syntax afterwards with the parser
of its family (``hermes``: ``<tool_call>{...}</tool_call>``; ``llama3_json``: a JSON object,
after ``<|python_tag|>`` or alone; ``mistral``: ``[TOOL_CALLS][{...}]``).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmpool.protocol.limits import MAX_JSON_DEPTH, nesting_depth

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

# Text that opens a call in each parser's syntax.
_CALL_MARKERS = {
    "hermes": "<tool_call>",
    "llama3_json": "<|python_tag|>",
    "mistral": "[TOOL_CALLS]",
}
# Some families also write a call as bare JSON at the very start of the output (Llama 3.x's JSON
# tool format; Mistral's marker is a special token, gone when special tokens are skipped).
_BARE_CALL_STARTS = {"llama3_json": "{", "mistral": "["}

_HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class Function:
    """A function the request offers as a tool (OpenAI's ``tools[i].function``)."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is ``none``, ``auto``, ``required`` or ``named`` (then ``name`` is the function)."""

    mode: str
    name: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# --- tools as grammar -------------------------------------------------------------------------


def forced_schema(
    functions: list[Function], choice: ToolChoice, parallel: bool
) -> dict[str, Any] | None:
    """The JSON schema a forced call's output must match; None when the call is not forced."""
    if choice.mode == "named":
        return next(f.parameters for f in functions if f.name == choice.name)
    if choice.mode != "required":
        return None
    # Each tool's parameters move under $defs, and their local $refs ("#/...") are rewritten to
    # point there, so that tools whose schemas have $defs of the same name never collide.
    definitions = {
        f"tool_{index}": _rebase_refs(f.parameters, f"#/$defs/tool_{index}")
        for index, f in enumerate(functions)
    }
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f.name]},
                "parameters": {"$ref": f"#/$defs/tool_{index}"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for index, f in enumerate(functions)
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": branches},
        "$defs": definitions,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebase_refs(schema: Any, base: str) -> Any:
    """A copy of ``schema`` whose local ``$ref``s (``#``, ``#/...``) are relative to ``base``."""
    rebased = copy.deepcopy(schema)
    stack = [rebased]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                node["$ref"] = base + ref[1:]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return rebased


# --- tools in the prompt ----------------------------------------------------------------------


def hermes_system_block(functions: list[Function]) -> str:
    """The tools as Hermes / Qwen2.5 templates write them into the system message."""
    tools = "\n".join(json.dumps(f.to_openai(), ensure_ascii=False) for f in functions)
    return _HERMES_SYSTEM.format(tools=tools)


def hermes_messages(
    messages: list[dict[str, Any]], functions: list[Function]
) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the tools merged into the system
    message, calls written as ``<tool_call>`` blocks, and each run of ``tool`` results as one
    user message of ``<tool_response>`` blocks (Qwen2.5's template does the same)."""
    rendered: list[dict[str, Any]] = []
    previous_role = None
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = [_hermes_call(call) for call in message["tool_calls"]]
            content = "\n".join(filter(None, [message["content"], *calls]))
            rendered.append({"role": "assistant", "content": content})
        elif role == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if previous_role == "tool":
                rendered[-1]["content"] += "\n" + response
            else:
                rendered.append({"role": "user", "content": response})
        else:
            rendered.append(dict(message))
        previous_role = role
    if functions:
        block = hermes_system_block(functions)
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{block}".lstrip()
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered


def _hermes_call(call: dict[str, Any]) -> str:
    function = call["function"]
    call_json = {"name": function["name"], "arguments": _arguments_value(function["arguments"])}
    return f"<tool_call>\n{json.dumps(call_json, ensure_ascii=False)}\n</tool_call>"


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools itself: call arguments as objects, since
    templates write them with ``tojson`` (vLLM passes them so too)."""
    rendered = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {
                    **call,
                    "function": {
                        **call["function"],
                        "arguments": _arguments_value(call["function"]["arguments"]),
                    },
                }
                for call in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        rendered.append(message)
    return rendered


def _arguments_value(arguments: str) -> Any:
    """The arguments as JSON, or as the string they came as when that is not JSON or nests
    deeper than a request may (a template writes them back with a recursive ``tojson``)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return arguments if nesting_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH else value


def detect_parser(chat_template: str | None) -> str:
    """The parser for the call syntax a chat template teaches; Hermes when it shows none."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3_json"
    return "hermes"


# --- model output as calls --------------------------------------------------------------------


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """The content before any call (None when blank) and the calls in ``text``; no calls when the
    text holds none that parse, and then the whole text is the content."""
    marker = _CALL_MARKERS[parser]
    start = text.find(marker)
    if start == -1:
        bare = _BARE_CALL_STARTS.get(parser)
        if bare is None or not text.lstrip().startswith(bare):
            return text, []
        start, body = 0, text.lstrip()
    else:
        body = text[start + len(marker) :]
    calls = _hermes_calls(body) if parser == "hermes" else _json_calls(body)
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _hermes_calls(body: str) -> list[ToolCall]:
    """``{call}</tool_call>`` blocks, each but the first after its own ``<tool_call>``."""
    calls = []
    for block in body.split(_CALL_MARKERS["hermes"]):
        found = _json_calls(block.split("</tool_call>", 1)[0])
        if len(found) != 1:
            return []
        calls.extend(found)
    return calls


def _json_calls(body: str) -> list[ToolCall]:
    """Call objects, or arrays of them, separated by ``;`` (Llama 3.x) at the start of ``body``;
    whatever follows the last (an end-of-turn token's text) is ignored."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    position = len(body) - len(body.lstrip())
    while True:
        try:
            value, position = decoder.raw_decode(body, position)
        except ValueError:
            return []
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return []
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):  # some models write the arguments as JSON text
                arguments = _arguments_value(arguments)
            calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
        rest = body[position:].lstrip()
        if not rest.startswith(";"):
            return calls
        position = len(body) - len(rest[1:].lstrip())


def required_calls(text: str) -> list[ToolCall]:
    """The calls of a ``required`` answer, an array of ``{name, parameters}``: each complete
    item, and for an answer cut off by ``max_tokens`` inside an item whose name is written, that
    call with the arguments written so far (as a named call cut off returns them)."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    rest = text.lstrip()
    if not rest.startswith("["):
        return []
    rest = rest[1:]
    while True:
        rest = rest.lstrip().removeprefix(",").lstrip()
        try:
            item, end = decoder.raw_decode(rest)
        except ValueError:
            cut = _cut_off_call(rest)
            return calls if cut is None else [*calls, cut]
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return calls
        arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(ToolCall(item["name"], arguments))
        rest = rest[end:]


# An item cut off after its name: the grammar writes the schema's properties in order, name first.
_CUT_OFF_ITEM = re.compile(
    r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*(?:,\s*"parameters"\s*:\s*(?P<arguments>.*))?',
    re.DOTALL,
)


def _cut_off_call(rest: str) -> ToolCall | None:
    """The call an unfinished item begins, its arguments the text written so far; None before
    its name is whole."""
    match = _CUT_OFF_ITEM.match(rest)
    if match is None:
        return None
    try:
        name = json.loads(match["name"])
    except ValueError:  # an escape the cut left unfinished
        return None
    return ToolCall(name, match["arguments"] or "")


# --- responses ---------------------------------------------------------------------------------


class ToolCallShaper:
    """Turns one request's choices into OpenAI messages and stream deltas with ``tool_calls``."""

    def __init__(self, choice: ToolChoice, parser: str) -> None:
        self.choice = choice
        self.parser = parser

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message for a whole choice, and its finish reason."""
        content, calls = self.split(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, _finish_reason(finish_reason, calls)

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (None when there is none) and the calls of a whole choice's text."""
        if self.choice.mode == "named":
            assert self.choice.name is not None
            return None, [ToolCall(self.choice.name, text)]
        if self.choice.mode == "required":
            # The grammar allows nothing but the array: even one cut off before any call is
            # not content.
            return None, required_calls(text)
        return parse_tool_calls(self.parser, text)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One choice's stream: content deltas go out as they come until a call may have begun;
    from there text is held, and the calls go out whole when the choice ends. A named call is
    streamed as its arguments grow."""

    def __init__(self, shaper: ToolCallShaper) -> None:
        self.shaper = shaper
        self.mode = shaper.choice.mode
        self.held = ""  # text not sent yet
        self.in_call = self.mode == "required"  # everything is held until the end
        self.sent_any = False
        self.named_call: ToolCall | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The message deltas to send for ``text``."""
        if self.mode == "named":
            return self._named_deltas(text)
        self.held += text
        if self.in_call:
            return []
        marker = _CALL_MARKERS[self.shaper.parser]
        start = self.held.find(marker)
        if start != -1:
            self.in_call = True
            return self._content(self.held[:start], keep=self.held[start:])
        bare = _BARE_CALL_STARTS.get(self.shaper.parser)
        if not self.sent_any and bare is not None:
            stripped = self.held.lstrip()
            if stripped.startswith(bare):
                self.in_call = True
                return []
            if not stripped:
                return []  # only whitespace yet: the call may still begin
        keep = _marker_prefix_length(self.held, marker)
        return self._content(
            self.held[: len(self.held) - keep], keep=self.held[-keep:] if keep else ""
        )

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas of the choice, and its finish reason."""
        if self.mode == "named":
            return [], _finish_reason(finish_reason, [self.named_call] if self.named_call else [])
        content, calls = self.shaper.split(self.held) if self.in_call else (self.held, [])
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        deltas += [
            {"tool_calls": [{"index": index, **call.to_openai()}]}
            for index, call in enumerate(calls)
        ]
        return deltas, _finish_reason(finish_reason, calls)

    def _content(self, text: str, keep: str) -> list[dict[str, Any]]:
        self.held = keep
        if not text:
            return []
        self.sent_any = True
        return [{"content": text}]

    def _named_deltas(self, text: str) -> list[dict[str, Any]]:
        if self.named_call is None:
            assert self.shaper.choice.name is not None
            self.named_call = ToolCall(self.shaper.choice.name, "")
            opening = {"index": 0, **self.named_call.to_openai()}
            opening["function"]["arguments"] = text
            return [{"tool_calls": [opening]}]
        if not text:
            return []
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]


def _marker_prefix_length(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _finish_reason(finish_reason: str | None, calls: list[ToolCall]) -> str | None:
    """A choice that ended on its own with calls ends as ``tool_calls`` (cut-off ones keep
    ``length``)."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
