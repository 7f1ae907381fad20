"""The ``usage`` an engine reports, read from its response as the gateway relays it.

A stream's usage is its own event (``"choices": []`` and ``"usage"``), asked for upstream on
every stream (``stream_options.include_usage``) and kept from a client that did not ask for it;
a Responses stream's is in its last event's response (``response.completed``), always sent.
A JSON answer's usage is its last field, as the engine writes it: only the body's tail is kept,
so reading it costs no copy of the body. Responses count ``input_tokens`` and
``output_tokens`` where chat and completions count ``prompt_tokens`` and ``completion_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

USAGE_FIELD = b'"usage":'  # never inside a JSON string, where quotes are escaped
EVENT_END = b"\n\n"  # never inside an event, where JSON escapes line breaks
DONE_EVENT = b"data: [DONE]" + EVENT_END
TAIL_BYTES = 4096  # far more than a usage object's JSON


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_of(value: Any) -> Usage | None:
    """``value`` read as OpenAI's usage object; None if it is not one."""
    if not isinstance(value, dict):
        return None
    prompt: Any = value.get("prompt_tokens", value.get("input_tokens"))
    completion: Any = value.get("completion_tokens", value.get("output_tokens"))
    if not all(_is_count(count) for count in (prompt, completion)):
        return None
    return Usage(prompt, completion)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class UsageReader(Protocol):
    @property
    def usage(self) -> Usage | None:
        """What the response reported, once read; None until then (or if it reported none)."""

    @property
    def events(self) -> int:
        """Events passed on that may carry tokens (a stream's, but its usage and ``[DONE]``)."""

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` goes on to the client (possibly held back until a later chunk)."""

    def flush(self) -> bytes:
        """What was held back, once the response has ended."""


class StreamUsage:
    """Reads server-sent events whole; the usage event is recorded, and passed on only when
    ``forward`` (the client asked for it)."""

    def __init__(self, forward: bool) -> None:
        self.forward = forward
        self._usage: Usage | None = None
        self._partial = b""  # an event not ended yet
        self._events = 0

    def feed(self, chunk: bytes) -> bytes:
        data = self._partial + chunk
        end = data.rfind(EVENT_END)
        if end < 0:
            self._partial = data
            return b""
        whole, self._partial = data[: end + len(EVENT_END)], data[end + len(EVENT_END) :]
        self._events += whole.count(EVENT_END) - whole.count(DONE_EVENT)
        if USAGE_FIELD not in whole:
            return whole
        kept = [event for event in whole.split(EVENT_END)[:-1] if not self._is_usage(event)]
        return b"".join(event + EVENT_END for event in kept)

    def flush(self) -> bytes:
        partial, self._partial = self._partial, b""
        return partial

    @property
    def usage(self) -> Usage | None:
        return self._usage

    @property
    def events(self) -> int:
        return self._events - (self._usage is not None)

    def _is_usage(self, event: bytes) -> bool:
        """Records the usage of a usage event; True when the event is to be kept from the client."""
        # A Responses event names its type on a line before its data.
        data = next((line for line in event.split(b"\n") if line.startswith(b"data: ")), None)
        if USAGE_FIELD not in event or data is None:
            return False
        try:
            payload = json.loads(data[len(b"data: ") :])
        except ValueError:
            return False
        if not isinstance(payload, dict):
            return False
        final = payload.get("response")  # a Responses event's
        usage = usage_of(final.get("usage") if isinstance(final, dict) else payload.get("usage"))
        if usage is None:
            return False
        self._usage = usage
        return not self.forward and payload.get("choices") == []


class BodyUsage:
    """Passes a JSON body through whole, keeping its tail, where the engine writes usage."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        self._tail = (self._tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]
        return chunk

    def flush(self) -> bytes:
        return b""

    events = 0

    @property
    def usage(self) -> Usage | None:
        start = self._tail.rfind(USAGE_FIELD)
        if start < 0:
            return None
        try:
            value, _ = json.JSONDecoder().raw_decode(
                self._tail[start + len(USAGE_FIELD) :].decode(errors="replace").lstrip()
            )
        except ValueError:
            return None
        return usage_of(value)


def usage_reader(content_type: str, forward_stream_usage: bool) -> UsageReader:
    if content_type.startswith("text/event-stream"):
        return StreamUsage(forward_stream_usage)
    return BodyUsage()
