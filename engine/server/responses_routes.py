"""The Responses API routes: ``POST /v1/responses`` on the chat path, and the stored responses
(``GET`` and ``DELETE /v1/responses/{id}``, ``previous_response_id``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmpool.engine.server.async_engine import EngineStoppedError, RequestFailedError, RequestStream
from llmpool.engine.server.response_store import ResponseStore, owner_of
from llmpool.engine.server.responses import ResponseBuilder
from llmpool.engine.server.responses_api import (
    input_messages,
    parse_responses_request,
    previous_response_id,
    renamed,
)
from llmpool.engine.server.responses_output import (
    ResponseEvents,
    ResponseShape,
    output_items,
    usage,
)
from llmpool.engine.server.sse import SSEResponse
from llmpool.protocol.errors import APIError, parse_json_body
from llmpool.protocol.http import read_body

if TYPE_CHECKING:
    from llmpool.engine.server.app import OpenAIServer


class ResponsesRoutes:
    def __init__(self, server: OpenAIServer, store: ResponseStore) -> None:
        self.server = server
        self.store = store

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        raw = await read_body(request)
        owner = owner_of(request)
        server = self.server
        try:
            asked, history, parsed, output, prompt, adapter = await server.off_loop(
                lambda body: self._prepare(body, owner), raw
            )
            structured_outputs = await server.compile_constraint(output.constraint)
            response_id = self.store.new_id()
            stream, builder = await server.submit(
                "chat", response_id, parsed, [prompt], arrival, structured_outputs,
                server.tool_call_shaper(output), adapter,
            )  # fmt: skip
        except APIError as error:
            raise renamed(error) from None
        shape = ResponseShape(response_id, adapter or server.model_name, asked.echo, asked.store)
        shape.previous_response_id = asked.previous_response_id
        conversation = history + asked.messages
        if asked.stream:
            return SSEResponse(
                self._events(stream, builder, shape, len(prompt), owner, conversation)
            )
        try:
            choices = await server.collect(request, stream, 1)
        finally:
            stream.abort()
        if choices is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choice = builder.response(choices, len(prompt))["choices"][0]
        body = shape.response(
            "done",
            output_items(choice["message"]),
            usage(len(prompt), len(choices[0].token_ids)),
            choice["finish_reason"],
        )
        self._keep(owner, body, conversation)
        return JSONResponse(body)

    def _prepare(self, raw: bytes, owner: str) -> tuple[Any, ...]:
        """Off the event loop: the body read, the earlier turns it continues, and its chat body
        checked and templated."""
        body = parse_json_body(raw)
        previous = previous_response_id(body)
        history = []
        if previous is not None:
            history = self.store.get(owner, previous, "previous_response_id").conversation
        asked, chat = parse_responses_request(body, history)
        return (asked, history, *self.server.prepare_chat_body(chat))

    async def _events(
        self,
        stream: RequestStream,
        builder: ResponseBuilder,
        shape: ResponseShape,
        prompt_tokens: int,
        owner: str,
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        events = ResponseEvents(shape)
        calls = None if builder.tool_calls is None else builder.tool_calls.stream()
        output_tokens, finish_reason = 0, None
        try:
            yield events.start()
            async for _, delta in stream:
                output_tokens += len(delta.new_token_ids)
                messages = (
                    [{"content": delta.new_text}] if calls is None else calls.feed(delta.new_text)
                )
                if delta.finished:
                    finish_reason = delta.finish_reason
                    if calls is not None:
                        last, finish_reason = calls.finish(delta.finish_reason)
                        messages += last
                yield b"".join(events.feed(message) for message in messages)
            closing, body = events.finish(prompt_tokens, output_tokens, finish_reason)
            self._keep(owner, body, conversation)
            yield closing
        except EngineStoppedError as error:
            yield events.fail({"code": "service_unavailable", "message": str(error)})
        except RequestFailedError as error:
            yield events.fail({"code": "internal_error", "message": str(error)})
        finally:
            stream.abort()

    def _keep(self, owner: str, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Store the response (``store``) with the conversation a next turn continues."""
        if body["store"]:
            answer = input_messages(body["output"]) if body["output"] else []
            self.store.put(owner, body, conversation + answer)

    async def retrieve(self, request: Request) -> Response:
        stored = self.store.get(owner_of(request), request.path_params["response_id"])
        return JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        self.store.delete(owner_of(request), response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
