"""Talking to one replica: open its response, then relay the body chunk by chunk to the client."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from llmpool.gateway.usage import UsageReader, usage_reader
from llmpool.protocol.disconnect import ClientGone, disconnect_watcher, unless_gone
from llmpool.protocol.errors import APIError
from llmpool.protocol.response_ids import TENANT_HEADER

# What a client sends that the engine needs, and what the engine answers that a client needs.
# Never the client's Authorization: its key is the gateway's business; the engine gets the
# pool's engine key instead.
REQUEST_HEADERS = ("content-type", "accept", "x-request-id")
RESPONSE_HEADERS = ("content-type", "cache-control", "retry-after", "x-request-id")


class UpstreamFailed(Exception):
    """The replica failed before sending a byte of its response; ``kind`` names how."""

    def __init__(self, kind: str, detail: str, response: httpx.Response | None = None) -> None:
        super().__init__(detail)
        self.kind = kind
        self.response = response  # the closed 503, when the replica answered one


async def open_response(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    engine_key: str | None = None,
    tenant: str | None = None,
    method: str = "POST",
) -> httpx.Response:
    """``method`` with ``engine_key`` as the bearer token (None: none) and ``tenant`` in
    TENANT_HEADER (who owns stored responses), and wait for the response head; a failure before
    it raises ``UpstreamFailed``."""
    forwarded = {name: headers[name] for name in REQUEST_HEADERS if name in headers}
    forwarded["content-length"] = str(len(body))
    if engine_key is not None:
        forwarded["authorization"] = f"Bearer {engine_key}"
    if tenant is not None:
        forwarded[TENANT_HEADER] = tenant
    # As a generator, so that the request keeps no reference to the body once it is sent: a
    # long stream then holds none of it.
    request = client.build_request(method, url, content=_once(body), headers=forwarded)
    try:
        response = await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as error:
        raise UpstreamFailed("connect", f"cannot connect: {type(error).__name__} {error}") from None
    except httpx.TransportError as error:
        # Accepted but no response head: the replica died or closed first. Nothing reached the
        # client yet, so another replica may run the request.
        raise UpstreamFailed("disconnected", f"{type(error).__name__}: {error}") from None
    if response.status_code == 503:
        await response.aread()
        await response.aclose()
        raise UpstreamFailed("unavailable", "the replica answered 503", response)
    return response


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


class RelayResponse(Response):
    """An ASGI response that streams an upstream response through as its chunks arrive.

    Each chunk is sent before the next is read, so a slow client slows the replica (backpressure).
    A client that goes away closes the upstream connection, which makes the engine abort. A
    replica that breaks mid-stream ends an event stream with an error event and ``[DONE]``.
    The usage the replica reports is read on the way (``usage.py``); ``on_usage`` gets the
    status and that reader when the response ends, however it ends.
    """

    def __init__(
        self,
        upstream: httpx.Response,
        on_done: Callable[[], None],
        on_broken: Callable[[str], None],
        on_usage: Callable[[int, UsageReader], None],
        forward_stream_usage: bool = True,
    ) -> None:
        # Response.__init__ would render a body; this response has none of its own.
        self.status_code = upstream.status_code
        self.background = None
        self.upstream = upstream
        self.on_done = on_done
        self.on_broken = on_broken
        self.on_usage = on_usage
        self.reader = usage_reader(upstream.headers.get("content-type", ""), forward_stream_usage)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (name.encode(), value.encode())
            for name in RESPONSE_HEADERS
            if (value := self.upstream.headers.get(name)) is not None
        ]
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.upstream.status_code,
                    "headers": headers,
                }
            )
            # The relay and the watcher both finish before the upstream closes under them.
            async with disconnect_watcher(receive) as gone:
                with contextlib.suppress(ClientGone):
                    await unless_gone(self._relay(send), gone)
        finally:
            await self.upstream.aclose()
            self.on_usage(self.upstream.status_code, self.reader)
            self.on_done()

    async def _relay(self, send: Send) -> None:
        try:
            async for chunk in self.upstream.aiter_raw():
                if relayed := self.reader.feed(chunk):
                    await send({"type": "http.response.body", "body": relayed, "more_body": True})
            if held_back := self.reader.flush():
                await send({"type": "http.response.body", "body": held_back, "more_body": True})
        except httpx.TransportError as error:
            self.on_broken(f"{type(error).__name__}: {error}")
            if self.upstream.headers.get("content-type", "").startswith("text/event-stream"):
                await send(
                    {
                        "type": "http.response.body",
                        "body": broken_stream_events(),
                        "more_body": True,
                    }
                )
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def broken_stream_events() -> bytes:
    error = APIError(
        502,
        "the replica serving this stream failed before it finished",
        type="upstream_error",
        code="upstream_stream_broken",
    )
    return f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
