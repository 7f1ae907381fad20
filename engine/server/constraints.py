"""What a request asks its output to match (``response_format``, ``structured_outputs``, a forced
tool call) and the tools it offers: read, bounded, and turned into one grammar spec or a 400.

The bounds keep what one request can make the server compile or hold small; each refusal names
the field. The grammar library bounds compile time and the compiled size on its own
(``structured_outputs.GrammarBudget``); what it cannot compile is a 400 from the server's compile step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from llmpool.engine.server.tool_calls import EMPTY_PARAMETERS, Function, ToolChoice, forced_schema
from llmpool.engine.structured_outputs import MAX_CHOICES, MAX_SPEC_BYTES, StructuredOutputsParams
from llmpool.protocol.errors import bad_request
from llmpool.protocol.limits import MAX_TOOLS, nesting_depth

MAX_SCHEMA_BYTES = MAX_SPEC_BYTES  # a schema serialized as compact JSON
MAX_SCHEMA_DEPTH = 32  # objects and arrays nested in a schema's JSON
MAX_CHOICE_CHARS = 4096  # one string of structured_outputs.choice
MAX_REGEX_CHARS = 8192
MAX_GRAMMAR_BYTES = MAX_SPEC_BYTES
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function and schema names
STRUCTURED_OUTPUTS_FIELDS = ("json", "json_object", "regex", "choice", "grammar")
# Requests fields in the order their conflicts are reported: the later one is named.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "tool_choice")


@dataclass(frozen=True)
class Constraint:
    """A grammar spec, the field a compile error names, and the kind counted in metrics."""

    params: StructuredOutputsParams
    param: str
    kind: str  # json_schema, json_object, regex, choice, grammar or tool_call


@dataclass(frozen=True)
class OutputSpec:
    """What a request asks of its output beyond sampling."""

    constraint: Constraint | None = None
    functions: list[Function] = field(default_factory=list)
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True


def _object_field(container: dict[str, Any], key: str, where: str, param: str) -> dict[str, Any]:
    """``container[key]``, which must be a JSON object: a 400 naming ``where.key`` if not."""
    value = container.get(key)
    if not isinstance(value, dict):
        raise bad_request(f"{where}.{key} must be an object", param=param)
    return value


def parse_output_spec(body: dict[str, Any], chat: bool) -> OutputSpec:
    """The output spec of a completions (``chat`` false) or chat body; tools only on chat."""
    functions = _tools(body.get("tools")) if chat else []
    tool_choice = _tool_choice(body.get("tool_choice"), functions) if chat else ToolChoice("none")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    asked = {
        "response_format": _response_format(body.get("response_format")),
        "structured_outputs": _structured_outputs(body.get("structured_outputs")),
        "tool_choice": _forced_call(functions, tool_choice, parallel),
    }
    given = [name for name in CONSTRAINT_FIELDS if asked[name] is not None]
    if len(given) > 1:
        raise bad_request(
            f"{given[1]} and {given[0]} both constrain the output; send only one of them",
            param=given[1],
        )
    constraint = asked[given[0]] if given else None
    return OutputSpec(constraint, functions, tool_choice, parallel)


# --- response_format and structured_outputs ---------------------------------------------------


def _response_format(value: Any) -> Constraint | None:
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), param, "json_object")
    if kind != "json_schema":
        raise bad_request(
            f"{param}.type must be text, json_object or json_schema, got {kind!r}", param=param
        )
    spec = _object_field(value, "json_schema", param, param)
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and NAME_PATTERN.fullmatch(name)):
        raise bad_request(
            f"{param}.json_schema.name must be 1 to 64 letters, digits, _ or -", param=param
        )
    for key, kinds in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            kind_name = "a boolean" if kinds is bool else "a string"
            raise bad_request(f"{param}.json_schema.{key} must be {kind_name}", param=param)
    schema = spec.get("schema")
    if schema is None:  # OpenAI makes the schema optional: any JSON object then
        return Constraint(StructuredOutputsParams(json_object=True), param, "json_schema")
    checked = _schema(schema, f"{param}.json_schema.schema", param)
    return Constraint(StructuredOutputsParams(json=checked), param, "json_schema")


def _structured_outputs(value: Any) -> Constraint | None:
    """vLLM's ``structured_outputs``: exactly one of json, json_object, regex, choice, grammar."""
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param=param)
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS_FIELDS))
    if unknown:
        raise bad_request(
            f"{param}.{unknown[0]} is not supported by this server; it takes"
            f" {', '.join(STRUCTURED_OUTPUTS_FIELDS)}",
            param=param,
        )
    given = [k for k in STRUCTURED_OUTPUTS_FIELDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(
            f"{param} takes exactly one of {', '.join(STRUCTURED_OUTPUTS_FIELDS)};"
            f" got {', '.join(given) or 'none'}",
            param=param,
        )
    key = given[0]
    spec = value[key]
    where = f"{param}.{key}"
    if key == "json_object":
        if spec is not True:
            raise bad_request(f"{where} must be a boolean", param=param)
        return Constraint(StructuredOutputsParams(json_object=True), param, "json_object")
    if key == "json":
        if isinstance(spec, str):
            spec = _text(spec, where, param, MAX_SCHEMA_BYTES)
            try:
                spec = json.loads(spec)
            except (ValueError, RecursionError) as error:
                raise bad_request(f"{where} is not valid JSON: {error}", param=param) from None
        params = StructuredOutputsParams(json=_schema(spec, where, param))
        return Constraint(params, param, "json_schema")
    if key == "regex":
        regex = _text(spec, where, param, MAX_REGEX_CHARS)
        return Constraint(StructuredOutputsParams(regex=regex), param, "regex")
    if key == "grammar":
        grammar = _text(spec, where, param, MAX_GRAMMAR_BYTES)
        return Constraint(StructuredOutputsParams(grammar=grammar), param, "grammar")
    return Constraint(StructuredOutputsParams(choice=_choices(spec, where, param)), param, "choice")


def _choices(value: Any, where: str, param: str) -> list[str]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_CHOICES:
        raise bad_request(f"{where} must be an array of 1 to {MAX_CHOICES} strings", param=param)
    for item in value:
        if not isinstance(item, str) or not item:
            raise bad_request(f"{where} must hold non-empty strings", param=param)
        _text(item, where, param, MAX_CHOICE_CHARS)
    return value


def _text(value: Any, where: str, param: str, max_size: int) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a non-empty string", param=param)
    if len(value) > max_size:
        raise bad_request(
            f"{where} has {len(value):,} characters; at most {max_size:,} are accepted",
            param=param,
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{where} is not valid Unicode (lone surrogate)", param=param) from None
    return value


def _schema(value: Any, where: str, param: str) -> dict[str, Any]:
    """A JSON schema object within the depth and size bounds, and serializable as JSON text."""
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be a JSON schema object", param=param)
    depth = nesting_depth(value, MAX_SCHEMA_DEPTH)
    if depth > MAX_SCHEMA_DEPTH:
        raise bad_request(
            f"{where} nests {depth} levels of objects and arrays; at most {MAX_SCHEMA_DEPTH}"
            " are accepted",
            param=param,
        )
    try:
        size = len(
            json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        )
    except UnicodeEncodeError:
        raise bad_request(f"{where} is not valid Unicode (lone surrogate)", param=param) from None
    except ValueError:
        raise bad_request(f"{where} must not hold NaN or Infinity", param=param) from None
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(
            f"{where} has {size:,} bytes as JSON; at most {MAX_SCHEMA_BYTES:,} are accepted",
            param=param,
        )
    return value


# --- tools --------------------------------------------------------------------------------------


def _tools(value: Any) -> list[Function]:
    param = "tools"
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(f"{param} must be an array", param=param)
    if len(value) > MAX_TOOLS:
        raise bad_request(
            f"{param} has {len(value)} tools; at most {MAX_TOOLS} are accepted", param=param
        )
    functions: list[Function] = []
    for index, tool in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f'{where} must be {{"type": "function", "function": ...}}', param=param
            )
        function = _object_field(tool, "function", where, param)
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise bad_request(
                f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                param=param,
            )
        if any(f.name == name for f in functions):
            raise bad_request(f"{where}.function.name {name!r} is given twice", param=param)
        description = function.get("description")
        if description is not None:
            description = _text(description, f"{where}.function.description", param, 10**6)
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise bad_request(f"{where}.function.strict must be a boolean", param=param)
        parameters = function.get("parameters")
        parameters = (
            EMPTY_PARAMETERS
            if parameters is None
            else _schema(parameters, f"{where}.function.parameters", param)
        )
        functions.append(Function(name, parameters, description))
    return functions


def _tool_choice(value: Any, functions: list[Function]) -> ToolChoice:
    param = "tool_choice"
    if value is None:
        return ToolChoice("auto" if functions else "none")
    if value == "none":
        return ToolChoice("none")
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                f'{param} must be none, auto, required or {{"type": "function", "function":'
                ' {"name": ...}}',
                param=param,
            )
        if not any(f.name == name for f in functions):
            raise bad_request(f"{param} names {name!r}, which is not among tools", param=param)
        return ToolChoice("named", name)
    if value not in ("auto", "required"):
        raise bad_request(
            f"{param} must be none, auto, required or a function, got {value!r}", param=param
        )
    if not functions:
        raise bad_request(f"{param} {value} needs tools", param=param)
    return ToolChoice(value)


def _forced_call(
    functions: list[Function], choice: ToolChoice, parallel: bool
) -> Constraint | None:
    schema = forced_schema(functions, choice, parallel)
    if schema is None:
        return None
    return Constraint(StructuredOutputsParams(json=schema), "tools", "tool_call")
