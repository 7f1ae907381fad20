"""What every OpenAI-compatible server of ours shares (the engine's and the gateway's): the error
response, the API key check, and request bodies read with a bound."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
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


async def route_error(request: Request, error: Exception) -> Response:
    """Starlette's own 404 (no such route) and 405 (a route without this method) as OpenAI
    errors, so a client's error handling sees the same shape as from every route."""
    assert isinstance(error, HTTPException)
    path = request.url.path
    headers = dict(error.headers or {})
    if error.status_code == 405:
        message = f"{request.method} is not allowed on {path}; it takes {headers.get('Allow')}"
        api_error = APIError(405, message, code="method_not_allowed", headers=headers)
    elif error.status_code == 404:
        api_error = APIError(404, f"there is no route {path}", code="not_found")
    else:
        api_error = APIError(error.status_code, error.detail, headers=headers)
    return error_response(api_error)


# ``Starlette(exception_handlers=...)`` of the engine's and the gateway's apps.
ROUTE_ERROR_HANDLERS = {HTTPException: route_error}
