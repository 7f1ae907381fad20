"""The gateway's own bounds: requests in progress, and request-body bytes held, at once.

A body is counted from the moment it is read (its Content-Length up front, so a body that
would not fit is refused before a byte of it is read) until its response has begun: then the
gateway holds none of it any more. Beyond either bound a request is a 503 with Retry-After, at
once, so that a burst of large bodies leaves room for small requests and never the gateway's
memory limit.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request

from llmpool.protocol.errors import APIError
from llmpool.protocol.http import MAX_BODY_BYTES

RETRY_AFTER_SECONDS = "1"


def unavailable(message: str, code: str) -> APIError:
    return APIError(
        503, message, type="service_unavailable", code=code,
        headers={"Retry-After": RETRY_AFTER_SECONDS},
    )  # fmt: skip


def busy(message: str) -> APIError:
    return unavailable(message, "gateway_busy")


def too_large() -> APIError:
    return APIError(
        413, f"the request body is larger than {MAX_BODY_BYTES:,} bytes", code="request_too_large"
    )


def once(action: Callable[[], None]) -> Callable[[], None]:
    """``action``, run by the first call only: a release that every path may call safely."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return run


class RequestBudget:
    """Counts requests and body bytes in progress; changed only on the event loop's thread."""

    def __init__(self, max_requests: int, max_body_bytes: int) -> None:
        if max_body_bytes < MAX_BODY_BYTES:
            raise ValueError(
                f"the body buffer ({max_body_bytes:,} bytes) must hold at least one body of the"
                f" largest size accepted ({MAX_BODY_BYTES:,} bytes)"
            )
        self.max_requests = max_requests
        self.max_body_bytes = max_body_bytes
        self.requests = 0
        self.body_bytes = 0

    def admit(self) -> Callable[[], None]:
        """Count a request in, or raise a 503; returns its release (idempotent)."""
        if self.requests >= self.max_requests:
            raise busy(f"the gateway already has {self.requests} requests in progress, its limit")
        self.requests += 1
        return once(lambda: setattr(self, "requests", self.requests - 1))

    async def read_body(self, request: Request) -> tuple[bytes, Callable[[], None]]:
        """The body, counted until the returned release (idempotent) is called."""
        reserved = 0

        def reserve(size: int) -> None:
            nonlocal reserved
            if size > MAX_BODY_BYTES:
                raise too_large()
            if size > reserved:
                if self.body_bytes + size - reserved > self.max_body_bytes:
                    raise busy(
                        f"the gateway holds {self.body_bytes:,} bytes of request bodies; this"
                        f" one of {size:,} would pass its limit of {self.max_body_bytes:,}"
                    )
                self.body_bytes += size - reserved
                reserved = size

        def release() -> None:
            nonlocal reserved
            self.body_bytes -= reserved
            reserved = 0

        try:
            declared = request.headers.get("content-length", "")
            if declared.isdigit():
                reserve(int(declared))
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                reserve(size)
                chunks.append(chunk)
            return b"".join(chunks), release
        except BaseException:
            release()
            raise
