"""Response objects and typed stream events of the Responses API, built from the chat path's
assistant messages and message deltas (those of ``ToolCallShaper`` with tools, else text).

A stream is, in OpenAI's order, each event with its ``sequence_number``: ``response.created``,
``response.in_progress``; per text answer ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per call
``response.output_item.added``, ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (``response.incomplete`` when cut at ``max_output_tokens``, or
``response.failed``), whose response is the one a request not streamed gets.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or new_item_id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [] if status == "in_progress" else [text_part(text)],
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict[str, Any], status: str, item_id: str | None = None) -> dict[str, Any]:
    """A chat tool call (``{"id", "function": {"name", "arguments"}}``) as a function_call item."""
    return {
        "id": item_id or new_item_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"].get("arguments", ""),
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The output of a whole chat answer: its text (if any), then its calls."""
    items = [text_item(message["content"], "completed")] if message.get("content") else []
    return items + [call_item(call, "completed") for call in message.get("tool_calls", [])]


class ResponseShape:
    """The response object of one request, in each of its states."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any], store: bool) -> None:
        self.id = response_id
        self.model = model
        self.echo = echo
        self.store = store
        self.previous_response_id: str | None = None
        self.created_at = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        finish_reason: str | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """``finish_reason`` (the chat answer's) decides completed or incomplete once done.
        ``usage`` is the last field, as in every answer of the engine: the gateway reads a
        body's usage from its tail (gateway/usage.py)."""
        if status == "done":
            status = "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            **self.echo,
            "usage": usage,
        }


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


class ResponseEvents:
    """The typed events of one streamed response, fed the chat path's message deltas."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # items done, and the one open (last) if any
        self.text: str | None = None  # the open message's text so far; None: none open
        self.call_ids: dict[int, int] = {}  # a chat call's index -> its item's output index
        self.open_call: int | None = None

    def start(self) -> bytes:
        created = self.shape.response("in_progress", [])
        return self._event("response.created", response=created) + self._event(
            "response.in_progress", response=created
        )

    def feed(self, delta: dict[str, Any]) -> bytes:
        events = []
        if delta.get("content"):
            events.append(self._text(delta["content"]))
        for call in delta.get("tool_calls", []):
            events.append(self._call(call))
        return b"".join(events)

    def finish(
        self, input_tokens: int, output_tokens: int, finish_reason: str | None
    ) -> tuple[bytes, dict[str, Any]]:
        """The closing events and the finished response object."""
        closing = self._close()
        response = self.shape.response(
            "done", self.output, usage(input_tokens, output_tokens), finish_reason
        )
        return closing + self._event(f"response.{response['status']}", response=response), response

    def fail(self, error: dict[str, Any]) -> bytes:
        failed = self.shape.response(
            "failed", self.output, error={"code": error["code"], "message": error["message"]}
        )
        return self._event("response.failed", response=failed)

    def _text(self, text: str) -> bytes:
        events = b""
        if self.text is None:
            events = self._close()
            self.text = ""
            item = text_item("", "in_progress")
            self.output.append(item)
            events += self._event("response.output_item.added", output_index=self._index, item=item)
            events += self._event(
                "response.content_part.added", **self._at_part, part=text_part("")
            )
        self.text += text
        return events + self._event("response.output_text.delta", **self._at_part, delta=text)

    def _call(self, call: dict[str, Any]) -> bytes:
        arguments = call.get("function", {}).get("arguments", "")
        events = b""
        if "id" in call:  # a new call opens
            events = self._close()
            item = call_item(
                {**call, "function": {**call["function"], "arguments": ""}}, "in_progress"
            )
            self.output.append(item)
            self.open_call = self.call_ids[call["index"]] = self._index
            events += self._event("response.output_item.added", output_index=self._index, item=item)
        index = self.call_ids[call["index"]]
        if arguments:
            self.output[index]["arguments"] += arguments
            events += self._event(
                "response.function_call_arguments.delta",
                item_id=self.output[index]["id"], output_index=index, delta=arguments,
            )  # fmt: skip
        return events

    def _close(self) -> bytes:
        """Events that end the open item, if any."""
        if self.text is not None:
            text, self.text = self.text, None
            item = self.output[-1]
            item.update(status="completed", content=[text_part(text)])
            return b"".join(
                (
                    self._event("response.output_text.done", **self._at_part, text=text),
                    self._event(
                        "response.content_part.done", **self._at_part, part=text_part(text)
                    ),
                    self._event("response.output_item.done", output_index=self._index, item=item),
                )
            )
        if self.open_call is not None:
            index, self.open_call = self.open_call, None
            item = self.output[index]
            item["status"] = "completed"
            return self._event(
                "response.function_call_arguments.done",
                item_id=item["id"], output_index=index, name=item["name"],
                arguments=item["arguments"],
            ) + self._event("response.output_item.done", output_index=index, item=item)  # fmt: skip
        return b""

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    @property
    def _at_part(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": self._index, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()
