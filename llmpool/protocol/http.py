"""What every OpenAI-compatible server of ours shares (the engine's and the gateway's): the error
response, the API key check, and request bodies read with a bound."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmpool.protocol.errors import APIError

logger = logging.getLogger(__name__)

# Far beyond any prompt that fits a context window; a bound on what one request may make us hold.
MAX_BODY_BYTES = 16 * 1024 * 1024

Handler = Callable[[Request], Awaitable[Response]]


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(
                413, f"the request body is larger than {MAX_BODY_BYTES:,} bytes",
                code="request_too_large",
            )  # fmt: skip
        chunks.append(chunk)
    return b"".join(chunks)


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    expected = f"Bearer {api_key}".encode()
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, expected):
        raise APIError(401, "incorrect or missing API key", code="invalid_api_key")


def openai_endpoint(
    handler: Handler,
    api_key: str | None,
    on_error: Callable[[APIError], None] | None = None,
) -> Handler:
    """``handler`` behind the API key, with every failure answered as an OpenAI-shaped error."""

    async def endpoint(request: Request) -> Response:
        try:
            check_api_key(request, api_key)
            return await handler(request)
        except APIError as error:
            if on_error is not None:
                on_error(error)
            return error_response(error)
        except Exception:
            logger.exception("internal error in %s", request.url.path)
            return error_response(
                APIError(500, "internal server error", type="internal_error", code="internal_error")
            )

    return endpoint
