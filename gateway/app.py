"""The gateway's starlette app: OpenAI routes that pick a pool and a replica, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmpool.engine.server.http import error_response, openai_endpoint, read_body
from llmpool.engine.server.protocol import APIError, bad_request, parse_json_body
from llmpool.gateway import routing
from llmpool.gateway.demand import DemandReporter, DemandWriter
from llmpool.gateway.load import LoadTracker, scrape_forever
from llmpool.gateway.metrics import GatewayMetrics
from llmpool.gateway.pools import Pool, PoolTable, Replica
from llmpool.gateway.proxy import RelayResponse, UpstreamFailed, open_response, wait_for_disconnect

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "1"
# Probe an idle upstream connection after 30 s, every 10 s, and give up after 3 misses: a
# replica gone without a FIN or RST fails its streams within about a minute. (Linux names;
# elsewhere, e.g. a developer's macOS, the system's keepalive timing applies.)
KEEPALIVE = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)] + [
    (socket.IPPROTO_TCP, getattr(socket, option), value)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
    if hasattr(socket, option)
]


@dataclass(frozen=True)
class GatewaySettings:
    api_key: str | None = None
    prefix_chars: int = routing.DEFAULT_PREFIX_CHARS
    load_factor: float = routing.DEFAULT_LOAD_FACTOR
    hold_timeout: float = 30.0  # how long a request waits for a pool without ready replicas
    max_held: int = 256  # requests held per pool at most; more are a 503 at once
    connect_timeout: float = 2.0
    scrape_interval: float = 1.0
    scrape_timeout: float = 2.0
    # Not ready once a watch loop has not heard from the API server for this long: a routing
    # table that silently stopped following the pools must not keep taking traffic. (Watches
    # end every 30 s and are re-listed on failure every 2 s; this is several of those.)
    max_table_age: float = 90.0


def _unavailable(message: str, code: str) -> APIError:
    return APIError(
        503, message, type="service_unavailable", code=code,
        headers={"Retry-After": RETRY_AFTER_SECONDS},
    )  # fmt: skip


class Gateway:
    """Holds the table, the load tracker and the upstream client; one method per route."""

    def __init__(
        self,
        table: PoolTable,
        settings: GatewaySettings,
        background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
        demand_writer: DemandWriter | None = None,
    ) -> None:
        self.table = table
        self.settings = settings
        self.tracker = LoadTracker()
        self.metrics = GatewayMetrics()
        self.demand = DemandReporter(table, self.tracker, demand_writer) if demand_writer else None
        self.background = [*background, *([self.demand.run] if self.demand else [])]
        # No read timeout (a queued request is legitimately silent), so TCP keepalive is what
        # ends a stream from a replica whose node vanished without closing its connections.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=settings.connect_timeout),
            limits=limits,
            transport=httpx.AsyncHTTPTransport(limits=limits, socket_options=KEEPALIVE),
        )
        self._created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        scrape_client = httpx.AsyncClient(timeout=self.settings.scrape_timeout)
        tasks = [
            asyncio.create_task(
                scrape_forever(
                    self.table, self.tracker, scrape_client, self.settings.scrape_interval
                )
            ),
            *(asyncio.create_task(run()) for run in self.background),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await scrape_client.aclose()
            await self.client.aclose()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self._openai(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._openai(self.chat_completions), methods=["POST"]),
            Route("/v1/models", self._openai(self.models), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]

    def _openai(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        def rejected(error: APIError) -> None:
            self.metrics.rejected.labels(reason=error.code or error.type).inc()

        return openai_endpoint(handler, self.settings.api_key, rejected)

    # --- generation ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._route(request, "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._route(request, "/v1/chat/completions")

    async def _route(self, request: Request, path: str) -> Response:
        raw = await read_body(request)
        body = parse_json_body(raw)
        pool = self._pool_for(body, request.headers.get("x-llmpool-priority"))
        key = routing.prefix_key(routing.prompt_text(body), self.settings.prefix_chars)
        # One hold budget for both attempts: a request refused by the only replica (it drains)
        # waits for the replica replacing it rather than failing.
        deadline = time.monotonic() + self.settings.hold_timeout
        tried: set[str] = set()
        failure: UpstreamFailed | None = None
        for attempt in range(2):
            try:
                pool, decision = await self._pick(pool, key, tried, deadline)
            except APIError:
                if failure is None:
                    raise
                break  # no other replica to retry on: the client gets the first failure
            replica = decision.replica
            labels = {"pool": pool.label, "replica": replica.name}
            reason = routing.RETRY if attempt else decision.reason
            self.metrics.requests.labels(decision=reason, **labels).inc()
            self.tracker.begin(replica)
            self.metrics.in_flight.labels(**labels).inc()
            done, broken = self._finishers(replica, labels)
            try:
                upstream = await self._open_unless_disconnected(
                    request, f"{replica.url}{path}", raw
                )
            except UpstreamFailed as error:
                done()
                self.metrics.upstream_errors.labels(kind=error.kind, **labels).inc()
                logger.warning("replica %s failed (%s): %s", replica.name, error.kind, error)
                tried.add(replica.url)
                failure = error
                continue
            except BaseException:
                done()
                raise
            if upstream is None:
                done()
                return Response(status_code=499)  # the client is gone; nobody reads this
            return RelayResponse(upstream, done, broken)
        assert failure is not None
        return self._failed(failure)

    def _finishers(
        self, replica: Replica, labels: dict[str, str]
    ) -> tuple[Callable[[], None], Callable[[str], None]]:
        """What runs when a response to ``replica`` ends, and when its stream breaks."""

        def done() -> None:
            self.tracker.end(replica)
            self.metrics.in_flight.labels(**labels).dec()

        def broken(detail: str) -> None:
            logger.warning("stream from %s broke: %s", replica.name, detail)
            self.metrics.upstream_errors.labels(kind="stream", **labels).inc()

        return done, broken

    def _pool_for(self, body: dict[str, Any], header: str | None) -> Pool:
        model = body.get("model")
        if not isinstance(model, str):
            raise bad_request("model must be a string naming a served model", param="model")
        pools = self.table.pools_serving(model)
        if not pools:
            served = ", ".join(self.table.served_models()) or "none"
            raise APIError(
                404, f"the model {model!r} does not exist; served models: {served}",
                param="model", code="model_not_found",
            )  # fmt: skip
        try:
            wanted = routing.requested_class(body.get("priority"), header)
        except routing.RoutingError as error:
            raise bad_request(str(error), param="priority", code=error.code) from None
        return routing.choose_pool(pools, wanted)

    async def _pick(
        self, pool: Pool, key: bytes, tried: set[str], deadline: float
    ) -> tuple[Pool, routing.Decision]:
        """A replica not tried yet, waiting until ``deadline`` (monotonic) for one to appear."""
        while True:
            pool = self.table.pool(pool.key) or pool
            started = time.perf_counter()
            candidates = [
                routing.Candidate(r, self.tracker.get(r).load, self.tracker.get(r).digest)
                for r in self.table.replicas(pool)
                if r.url not in tried
            ]
            try:
                healthy = routing.routable(pool, candidates)
            except routing.RoutingError as error:
                remaining = deadline - time.monotonic()
                if error.code != routing.NO_READY_REPLICA or remaining <= 0:
                    raise _unavailable(str(error), error.code) from None
                if self.tracker.held_count(pool) >= self.settings.max_held:
                    raise _unavailable(
                        f"{self.settings.max_held} requests already wait for a replica of"
                        f" {pool.label}", "hold_queue_full",
                    ) from None  # fmt: skip
                await self._hold(pool, remaining)
                continue
            decision = routing.choose_replica(key, healthy, load_factor=self.settings.load_factor)
            self.metrics.routing_latency.observe(time.perf_counter() - started)
            return pool, decision

    async def _hold(self, pool: Pool, timeout: float) -> None:
        """Wait until the table changes (a replica may have appeared), at most ``timeout``."""
        gauge = self.metrics.held_requests.labels(pool=pool.label)
        gauge.inc()
        try:
            with self.tracker.held(pool), contextlib.suppress(TimeoutError):
                if self.demand is not None:
                    self.demand.poke()
                await asyncio.wait_for(self.table.wait_for_change(), timeout)
        finally:
            gauge.dec()

    async def _open_unless_disconnected(self, request: Request, url: str, body: bytes) -> Any:
        """The upstream response once its head arrives, or None if the client left first.

        A non-streaming response's head comes only when generation is done, so the wait can be
        long; cancelling it closes the upstream connection, and the engine aborts.
        """
        opening = asyncio.ensure_future(open_response(self.client, url, body, request.headers))
        watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
        try:
            await asyncio.wait({opening, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if opening.done():
            return opening.result()
        opening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await opening
        return None

    def _failed(self, failure: UpstreamFailed) -> Response:
        """Both attempts failed (or no other replica was left): the last failure, for the client."""
        if failure.response is not None:
            return Response(
                failure.response.content,
                status_code=failure.response.status_code,
                headers={
                    "content-type": failure.response.headers.get(
                        "content-type", "application/json"
                    ),
                    "retry-after": failure.response.headers.get("retry-after", RETRY_AFTER_SECONDS),
                },
            )
        self.metrics.rejected.labels(reason="upstream_unreachable").inc()
        return error_response(
            _unavailable(f"no replica could take the request: {failure}", "upstream_unreachable")
        )

    # --- the rest -----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        data = [
            {"id": name, "object": "model", "created": self._created, "owned_by": "llmpool"}
            for name in self.table.served_models()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """Ready once the first list of pools and endpoints is in (before, every model is 404),
        and while the table keeps following the API server."""
        if not self.table.synced:
            return JSONResponse({"status": "not ready"}, status_code=503)
        age = self.table.age()
        if age > self.settings.max_table_age:
            body = {"status": "stale", "tableAgeSeconds": round(age)}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ready", "pools": len(self.table.pools())})

    async def prometheus(self, request: Request) -> Response:
        return Response(
            self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )


def build_app(
    table: PoolTable,
    settings: GatewaySettings,
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
    demand_writer: DemandWriter | None = None,
) -> Starlette:
    """``background``: coroutines that run for the app's life (the Kubernetes watches);
    ``demand_writer``: where held requests are recorded for the autoscaler (none: nowhere)."""
    gateway = Gateway(table, settings, background, demand_writer)
    app = Starlette(routes=gateway.routes(), lifespan=gateway.lifespan)
    app.state.gateway = gateway
    return app
