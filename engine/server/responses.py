"""OpenAI response bodies and stream events for completions and chat, built from engine deltas.

A stream event is the bytes of one server-sent event (``data: {json}\n\n``). Every chunk of a
request shares its envelope (id, object, created, model), so that part is serialized once per
request and each token only serializes its own choice: the event loop runs this once per token
while holding the GIL the engine thread needs. Requests with tools go through a
``ToolCallShaper`` instead, which holds text that may be a call; the others never touch it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from llmpool.engine.outputs import RequestDelta
from llmpool.engine.server.tool_calls import ToolCallShaper, ToolCallStream


@dataclass
class Choice:
    """One choice accumulated from its deltas (the non-streaming answer)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        self.logprobs.extend(delta.new_logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder:
    """Shapes choices and chunks for one request; ``kind`` is ``completion`` or ``chat``."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        tokenizer: Any,
        top_logprobs: int | None,
        tool_calls: ToolCallShaper | None = None,
    ) -> None:
        self.kind = kind
        self.tool_calls = tool_calls  # chat requests whose output may be tool calls
        self._tool_streams: dict[int, ToolCallStream] = {}
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        envelope = json.dumps(self._chunk_envelope(), ensure_ascii=False)
        # The chunk envelope with its closing brace replaced by the start of the choices list.
        self._chunk_prefix = f'data: {envelope[:-1]}, "choices": ['.encode()

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    # --- whole responses ----------------------------------------------------------------------

    def response(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        completion_tokens = sum(len(c.token_ids) for c in choices)
        if self.kind == "chat":
            rendered = []
            for c in choices:
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                finish_reason = c.finish_reason
                if self.tool_calls is not None:
                    message, finish_reason = self.tool_calls.message(c.text, c.finish_reason)
                rendered.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": self._logprobs(c.token_ids, c.logprobs),
                        "finish_reason": finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            body = self._envelope("chat.completion")
        else:
            rendered = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
            ]
            body = self._envelope("text_completion")
        return {**body, "choices": rendered, "usage": usage(prompt_tokens, completion_tokens)}

    # --- stream events ------------------------------------------------------------------------

    def role_event(self, index: int) -> bytes:
        """Chat streams open each choice with the assistant role, as OpenAI does."""
        return self._event(
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def delta_event(self, index: int, delta: RequestDelta) -> bytes:
        if self.tool_calls is not None:
            return self._tool_call_events(index, delta)
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            choice["delta"] = {"content": delta.new_text} if delta.new_text else {}
        else:
            choice["text"] = delta.new_text
        choice["logprobs"] = self._logprobs(delta.new_token_ids, delta.new_logprobs)
        choice["finish_reason"] = delta.finish_reason if delta.finished else None
        choice["stop_reason"] = delta.stop_reason if delta.finished else None
        return self._event(choice)

    def _tool_call_events(self, index: int, delta: RequestDelta) -> bytes:
        """The events for a delta of a choice with tools: its content and tool-call deltas as the
        choice's stream releases them; logprobs ride on the first, the finish on its own last."""
        assert self.tool_calls is not None
        stream = self._tool_streams.get(index)
        if stream is None:
            stream = self._tool_streams[index] = self.tool_calls.stream()
        messages = stream.feed(delta.new_text)
        finish_reason = None
        if delta.finished:
            last, finish_reason = stream.finish(delta.finish_reason)
            messages += last
        logprobs = self._logprobs(delta.new_token_ids, delta.new_logprobs)
        if logprobs is not None and not messages:
            messages = [{}]
        events = []
        for message in messages:
            choice = {"index": index, "delta": message, "logprobs": logprobs}
            events.append(self._event({**choice, "finish_reason": None}))
            logprobs = None
        if delta.finished:
            choice = {"index": index, "delta": {}, "logprobs": None}
            stop_reason = delta.stop_reason
            events.append(
                self._event({**choice, "finish_reason": finish_reason, "stop_reason": stop_reason})
            )
        return b"".join(events)

    def usage_event(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse_event(
            {
                **self._chunk_envelope(),
                "choices": [],
                "usage": usage(prompt_tokens, completion_tokens),
            }
        )

    def _chunk_envelope(self) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion")

    def _event(self, choice: dict[str, Any]) -> bytes:
        """The chunk ``{**envelope, "choices": [choice]}`` as an event, envelope pre-serialized."""
        body = json.dumps(choice, ensure_ascii=False).encode()
        return b"".join((self._chunk_prefix, body, b"]}\n\n"))

    # --- logprobs -----------------------------------------------------------------------------

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, float]]
    ) -> dict[str, Any] | None:
        if self.top_logprobs is None or not entries:
            return None
        if self.kind == "chat":
            return {
                "content": [
                    self._chat_logprob(t, e) for t, e in zip(token_ids, entries, strict=True)
                ]
            }
        tokens = [self._token(t) for t in token_ids]
        return {
            "tokens": tokens,
            "token_logprobs": [e[t] for t, e in zip(token_ids, entries, strict=True)],
            "top_logprobs": [{self._token(t): lp for t, lp in self._top(e)} for e in entries]
            if self.top_logprobs
            else None,
            "text_offset": _offsets(tokens),
        }

    def _chat_logprob(self, token_id: int, entry: dict[int, float]) -> dict[str, Any]:
        token = self._token(token_id)
        return {
            "token": token,
            "logprob": entry[token_id],
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {
                    "token": (text := self._token(t)),
                    "logprob": lp,
                    "bytes": list(text.encode("utf-8")),
                }
                for t, lp in self._top(entry)
            ],
        }

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        """The engine sends the chosen token plus the top k; the top k are the k best of those."""
        return sorted(entry.items(), key=lambda item: item[1], reverse=True)[: self.top_logprobs]

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def sse_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def _offsets(tokens: list[str]) -> list[int]:
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return offsets
