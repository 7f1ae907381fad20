"""The gateway's starlette app: OpenAI routes that pick a pool and a replica, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmpool.fleet_key import FleetKey
from llmpool.gateway import routing, stored_responses
from llmpool.gateway.budget import RETRY_AFTER_SECONDS, RequestBudget, once, unavailable
from llmpool.gateway.demand import DemandReporter, DemandWriter
from llmpool.gateway.limits import Admission, TenantLimiter
from llmpool.gateway.load import LoadTracker, scrape_forever
from llmpool.gateway.metrics import GatewayMetrics
from llmpool.gateway.pools import Pool, PoolTable, Replica
from llmpool.gateway.proxy import RelayResponse, UpstreamFailed, open_response
from llmpool.gateway.request import (
    RequestFacts,
    prompt_estimate,
    read_facts,
    upstream_body,
)
from llmpool.gateway.tenants import KeyRing, Tenant
from llmpool.gateway.usage import Usage, UsageReader
from llmpool.protocol.disconnect import ClientGone, disconnect_watcher, unless_gone
from llmpool.protocol.errors import APIError, bad_request
from llmpool.protocol.http import ROUTE_ERROR_HANDLERS, error_response, openai_endpoint

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Probe an idle upstream connection after 30 s, every 10 s, and give up after 3 misses: a
# replica gone without a FIN or RST fails its streams within about a minute. (Linux names;
# elsewhere, e.g. a developer's macOS, the system's keepalive timing applies.)
KEEPALIVE = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)] + [
    (socket.IPPROTO_TCP, getattr(socket, option), value)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
    if hasattr(socket, option)
]


MIB = 1024 * 1024
# Bodies above this size are parsed (and rewritten) in a worker thread: a few 14 MB bodies
# parsed on the event loop would hold it for seconds, past the liveness probe's timeout.
PARSE_OFF_LOOP_BYTES = 64 * 1024


@dataclass(frozen=True)
class GatewaySettings:
    api_key: str | None = None  # the one-key mode (tenants.KeyRing); None and no Secrets: open
    # The key each pool's engines require (llmpool.fleet_key); no file: open engines.
    fleet_key: FleetKey = field(default_factory=lambda: FleetKey(None))
    prefix_chars: int = routing.DEFAULT_PREFIX_CHARS
    load_factor: float = routing.DEFAULT_LOAD_FACTOR
    hold_timeout: float = 30.0  # how long a request waits for a pool without ready replicas
    max_held: int = 256  # requests held per pool at most; more are a 503 at once
    # Requests in progress and request-body bytes held, gateway-wide; beyond, a 503 at once.
    max_requests: int = 1024
    max_body_bytes: int = 128 * MIB
    connect_timeout: float = 2.0
    scrape_interval: float = 1.0
    scrape_timeout: float = 2.0
    # Not ready once a watch loop has not heard from the API server for this long: a routing
    # table that silently stopped following the pools must not keep taking traffic. (Watches
    # end every 30 s and are re-listed on failure every 2 s; this is several of those.)
    max_table_age: float = 90.0
    # Gateway replicas behind the Service: tenant limits are per replica, so the effective
    # bound is this many times a limit (exported, not enforced).
    replicas: int = 1


def _in_turn(*actions: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        for action in actions:
            action()

    return run


class Gateway:
    """Holds the table, the keys, the limits and the upstream client; one method per route."""

    def __init__(
        self,
        table: PoolTable,
        settings: GatewaySettings,
        background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
        demand_writer: DemandWriter | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        self.table = table
        self.settings = settings
        self.keys = keys or KeyRing(settings.api_key)
        self.budget = RequestBudget(settings.max_requests, settings.max_body_bytes)
        self.limiter = TenantLimiter()
        self.tracker = LoadTracker()
        self.metrics = GatewayMetrics()
        self.metrics.buffered_body_bytes.set_function(lambda: self.budget.body_bytes)
        self.metrics.requests_in_progress.set_function(lambda: self.budget.requests)
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
            Route("/v1/responses", self._openai(self.responses), methods=["POST"]),
            Route(
                "/v1/responses/{response_id}",
                self._openai(self.stored_response),
                methods=["GET", "DELETE"],
            ),
            Route("/v1/models", self._openai(self.models), methods=["GET"]),
            Route("/v1/models/{model_id:path}", self._openai(self.model), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]

    def _openai(
        self, handler: Callable[[Request, Tenant], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """``handler`` for the caller's tenant (a 401 without a key it knows), every failure
        answered as an OpenAI error and counted, by tenant once known."""

        async def authenticated(request: Request) -> Response:
            tenant = self.keys.authenticate(request.headers.get("authorization"))
            try:
                return await handler(request, tenant)
            except APIError as error:
                outcome = error.code or error.type
                self.metrics.tenant_requests.labels(tenant=tenant.name, outcome=outcome).inc()
                raise

        def rejected(error: APIError) -> None:
            self.metrics.rejected.labels(reason=error.code or error.type).inc()

        return openai_endpoint(authenticated, None, rejected)

    # --- generation ---------------------------------------------------------------------------

    async def completions(self, request: Request, tenant: Tenant) -> Response:
        return await self._route(request, tenant, "/v1/completions")

    async def chat_completions(self, request: Request, tenant: Tenant) -> Response:
        return await self._route(request, tenant, "/v1/chat/completions")

    async def responses(self, request: Request, tenant: Tenant) -> Response:
        return await self._route(request, tenant, "/v1/responses")

    async def stored_response(self, request: Request, tenant: Tenant) -> Response:
        """GET or DELETE a stored response at the replica its id names, among the pools the
        tenant may use; the engine answers for its owner (the tenant header) alone."""
        response_id = request.path_params["response_id"]
        replicas = {
            replica.url: (pool, replica)
            for pool in self.table.pools()
            if tenant.may_use(pool)
            for replica in self.table.replicas(pool)
        }
        replica = stored_responses.holder([r for _, r in replicas.values()], response_id)
        pool = replicas[replica.url][0]
        engine_key = self.settings.fleet_key.engine_key(pool.namespace, pool.name)
        try:
            upstream = await open_response(
                self.client, f"{replica.url}/v1/responses/{response_id}", b"", request.headers,
                engine_key, tenant.name, request.method,
            )  # fmt: skip
        except UpstreamFailed as failure:
            return self._failed(failure)
        try:
            content = await upstream.aread()
        finally:
            await upstream.aclose()
        content_type = upstream.headers.get("content-type", "application/json")
        return Response(content, upstream.status_code, media_type=content_type)

    async def _route(self, request: Request, tenant: Tenant, path: str) -> Response:
        """Admit (gateway bounds and the tenant's limits before the body is read, then the
        tenant's token reservation), route and relay. What was counted in is counted out when
        the relayed response ends (its tokens settled against its usage), or at once on any
        other answer."""
        releases = [self.budget.admit()]

        @once
        def finish() -> None:
            for release in releases:
                release()

        admission: Admission | None = None
        try:
            declared = request.headers.get("content-length", "")
            admission = self.limiter.admit(
                tenant.name,
                tenant.limits,
                prompt_estimate(int(declared)) if declared.isdigit() else 0,
            )
            releases.append(admission.release)
            raw, release_body = await self.budget.read_body(request)
            try:
                facts = await _off_loop_if_large(raw, read_facts, raw, path,
                                                 self.settings.prefix_chars)  # fmt: skip
                pool, adapter = self._pool_for(
                    facts, tenant, request.headers.get("x-llmpool-priority")
                )
                admission.reserve(facts.cost)
                releases.append(self._count_in(tenant, facts))
                model = adapter or pool.served_name
                # A name qualified as namespace/name, or a stream to ask for its usage.
                if facts.model != model or facts.forces_usage:
                    raw = await _off_loop_if_large(
                        raw, upstream_body, raw, model, facts.forces_usage
                    )
                pinned = self._holder(pool, facts)
                # One watcher of the client for the whole wait: a held request whose client
                # left is dropped at once, and stops counting as demand.
                async with disconnect_watcher(request.receive) as disconnected:
                    response = await self._forward(
                        request, tenant, pool, adapter, facts, path, raw, finish, disconnected,
                        self._settler(tenant, admission, facts), pinned,
                    )  # fmt: skip
            finally:
                del raw  # the body's last reference here: once the upstream has it, it is gone
                release_body()
        except ClientGone:
            self._settle(tenant, admission, None, None)  # the engine may have generated it all
            finish()
            return Response(status_code=499)  # nobody reads this
        except APIError:
            self._settle(tenant, admission, 0, None)  # answered here: no engine ran it
            finish()
            raise
        except BaseException:
            self._settle(tenant, admission, None, None)
            finish()
            raise
        if not isinstance(response, RelayResponse):
            self._settle(tenant, admission, 0, None)  # no replica could take it
            finish()
        return response

    def _holder(self, pool: Pool, facts: RequestFacts) -> Replica | None:
        """The replica of ``pool`` holding the stored response a Responses request continues
        (``previous_response_id``); None for a request that continues none."""
        if facts.previous_response_id is None:
            return None
        return stored_responses.holder(
            self.table.replicas(pool), facts.previous_response_id, "previous_response_id"
        )

    def _settler(
        self, tenant: Tenant, admission: Admission, facts: RequestFacts
    ) -> Callable[[int, UsageReader], None]:
        """Settles a relayed response's tokens: its usage when the engine reported one; the
        prompt estimate for an engine's refusal (4xx: nothing was generated); else (a failure,
        a broken stream, a client gone before the usage came) the reservation, or more when a
        stream relayed more events than it reserved tokens for (each event past a chat
        stream's opening role events carries at least one token)."""

        def settle(status: int, reader: UsageReader) -> None:
            if reader.usage is not None:
                self._settle(tenant, admission, reader.usage.total_tokens, reader.usage)
            elif 400 <= status < 500:
                self._settle(tenant, admission, prompt_estimate(facts.body_bytes), None)
            else:
                relayed = prompt_estimate(facts.body_bytes) + reader.events - facts.choices
                self._settle(tenant, admission, max(admission.reserved, relayed), None)

        return settle

    def _settle(
        self, tenant: Tenant, admission: Admission | None, tokens: int | None, usage: Usage | None
    ) -> None:
        """Count ``tokens`` for the request (None: its reservation) and the usage reported."""
        if admission is None or admission.settled is not None:
            return
        admission.settle(admission.reserved if tokens is None else tokens)
        self.metrics.tenant_counted_tokens.labels(tenant=tenant.name).inc(admission.settled or 0)
        if usage is not None:
            for kind, count in (("prompt", usage.prompt_tokens),
                                ("completion", usage.completion_tokens)):  # fmt: skip
                self.metrics.tenant_usage_tokens.labels(tenant=tenant.name, kind=kind).inc(count)

    def _count_in(self, tenant: Tenant, facts: RequestFacts) -> Callable[[], None]:
        self.metrics.tenant_requests.labels(tenant=tenant.name, outcome="admitted").inc()
        self.metrics.tenant_tokens.labels(tenant=tenant.name).inc(facts.cost)
        in_flight = self.metrics.tenant_in_flight.labels(tenant=tenant.name)
        in_flight.inc()
        return in_flight.dec

    async def _forward(
        self,
        request: Request,
        tenant: Tenant,
        pool: Pool,
        adapter: str | None,
        facts: RequestFacts,
        path: str,
        raw: bytes,
        finish: Callable[[], None],
        disconnected: asyncio.Future[None],
        settle: Callable[[int, UsageReader], None],
        pinned: Replica | None = None,
    ) -> Response:
        """The response of a replica of ``pool`` (one with ``adapter``, if one is asked for),
        retried once on another; ``settle`` then ``finish`` run when a relayed response ends.
        Raises ClientGone when the client leaves first (``disconnected``). A ``pinned`` request
        (it continues a response stored there) goes to that replica alone: the others count as
        tried."""
        # One hold budget for both attempts: a request refused by the only replica (it drains)
        # waits for the replica replacing it rather than failing.
        deadline = time.monotonic() + self.settings.hold_timeout
        tried: set[str] = set()
        if pinned is not None:
            tried = {r.url for r in self.table.replicas(pool) if r.url != pinned.url}
        failure: UpstreamFailed | None = None
        key = routing.affinity_key(facts.prefix_key, adapter)
        for attempt in range(2):
            try:
                pool, decision = await self._pick(
                    pool, tenant, adapter, key, tried, deadline, disconnected
                )
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
                    f"{replica.url}{path}", raw, request, pool, tenant, disconnected
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
            return RelayResponse(
                upstream, _in_turn(done, finish), broken, settle,
                forward_stream_usage=not facts.forces_usage,
            )  # fmt: skip
        assert failure is not None
        return self._failed(failure)

    def _finishers(
        self, replica: Replica, labels: dict[str, str]
    ) -> tuple[Callable[[], None], Callable[[str], None]]:
        """What runs when a response from ``replica`` ends, and when its stream breaks."""

        def done() -> None:
            self.tracker.end(replica)
            self.metrics.in_flight.labels(**labels).dec()

        def broken(detail: str) -> None:
            logger.warning("stream from %s broke: %s", replica.name, detail)
            self.metrics.upstream_errors.labels(kind="stream", **labels).inc()

        return done, broken

    def _pool_for(
        self, facts: RequestFacts, tenant: Tenant, header: str | None
    ) -> tuple[Pool, str | None]:
        """Among the pools the tenant may use: those ``model`` names (a pool it may not use is
        as absent as one that does not exist), then the one of the requested class; and the
        adapter ``model`` names, if it names one."""
        visible = [pool for pool in self.table.pools() if tenant.may_use(pool)]
        try:
            pools, adapter = routing.resolve(visible, facts.model)
        except routing.RoutingError as error:
            raise APIError(error.status, str(error), param="model", code=error.code) from None
        try:
            wanted = routing.requested_class(facts.priority, header)
        except routing.RoutingError as error:
            raise bad_request(str(error), param="priority", code=error.code) from None
        return routing.choose_pool(pools, wanted), adapter

    async def _pick(
        self,
        pool: Pool,
        tenant: Tenant,
        adapter: str | None,
        key: bytes,
        tried: set[str],
        deadline: float,
        disconnected: asyncio.Future[None],
    ) -> tuple[Pool, routing.Decision]:
        """A replica not tried yet (with ``adapter`` loaded, if one is asked for), waiting until
        ``deadline`` (monotonic) for one to appear."""
        while True:
            if disconnected.done():
                raise ClientGone
            pool = self.table.pool(pool.key) or pool
            started = time.perf_counter()
            candidates = [
                self._candidate(r) for r in self.table.replicas(pool) if r.url not in tried
            ]
            try:
                healthy = routing.routable(pool, candidates, adapter)
            except routing.RoutingError as error:
                remaining = deadline - time.monotonic()
                if error.code not in routing.HELD_CODES or remaining <= 0:
                    raise unavailable(str(error), error.code) from None
                if self.tracker.held_count(pool) >= self.settings.max_held:
                    raise unavailable(
                        f"{self.settings.max_held} requests already wait for a replica of"
                        f" {pool.label}", "hold_queue_full",
                    ) from None  # fmt: skip
                await self._hold(pool, tenant, remaining, disconnected)
                continue
            decision = routing.choose_replica(key, healthy, load_factor=self.settings.load_factor)
            self.metrics.routing_latency.observe(time.perf_counter() - started)
            return pool, decision

    def _candidate(self, replica: Replica) -> routing.Candidate:
        load = self.tracker.get(replica)
        return routing.Candidate(replica, load.load, load.digest, load.adapters)

    async def _hold(
        self, pool: Pool, tenant: Tenant, timeout: float, disconnected: asyncio.Future[None]
    ) -> None:
        """Wait until the table changes (a replica may have appeared), a replica's fingerprint
        changes (an adapter may have been loaded) or the client leaves, at most ``timeout``.
        Counted as the pool's demand, and against the tenant's held limit."""
        gauges = (
            self.metrics.held_requests.labels(pool=pool.label),
            self.metrics.tenant_held.labels(tenant=tenant.name),
        )
        with self.limiter.held(tenant.name, tenant.limits), self.tracker.held(pool):
            for gauge in gauges:
                gauge.inc()
            if self.demand is not None:
                self.demand.poke()
            changes: set[asyncio.Future[Any]] = {
                asyncio.ensure_future(self.table.wait_for_change()),
                asyncio.ensure_future(self.tracker.wait_for_fingerprints()),
            }
            try:
                await asyncio.wait({*changes, disconnected}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            finally:
                for changed in changes:
                    changed.cancel()
                for gauge in gauges:
                    gauge.dec()

    async def _open_unless_disconnected(
        self,
        url: str,
        body: bytes,
        request: Request,
        pool: Pool,
        tenant: Tenant,
        disconnected: asyncio.Future[None],
    ) -> Any:
        """The upstream response once its head arrives; ClientGone if the client left first.

        A non-streaming response's head comes only when generation is done, so the wait can be
        long; cancelling it closes the upstream connection, and the engine aborts.
        """
        engine_key = self.settings.fleet_key.engine_key(pool.namespace, pool.name)
        return await unless_gone(
            open_response(self.client, url, body, request.headers, engine_key, tenant.name),
            disconnected,
        )

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
            unavailable(f"no replica could take the request: {failure}", "upstream_unreachable")
        )

    # --- the rest -----------------------------------------------------------------------------

    async def models(self, request: Request, tenant: Tenant) -> Response:
        return JSONResponse({"object": "list", "data": self._model_cards(tenant)})

    async def model(self, request: Request, tenant: Tenant) -> Response:
        """One model the tenant may use; any other (absent or another tenant's) is the same 404."""
        model_id = request.path_params["model_id"]
        for card in self._model_cards(tenant):
            if card["id"] == model_id:
                return JSONResponse(card)
        raise APIError(
            404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"
        )

    def _model_cards(self, tenant: Tenant) -> list[dict[str, Any]]:
        visible = [pool for pool in self.table.pools() if tenant.may_use(pool)]
        data = [
            {"id": name, "object": "model", "created": self._created, "owned_by": "llmpool"}
            for name in routing.model_ids(visible)
        ]
        data += [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "llmpool",
                "parent": parent,
            }
            for name, parent in routing.adapter_ids(visible).items()
        ]
        return data

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
        self.metrics.set_tenant_limits(self.keys.tenant_limits(), self.settings.replicas)
        return Response(
            self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )


async def _off_loop_if_large(raw: bytes, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` on the event loop for a small ``raw`` body, in a worker thread for a
    large one (PARSE_OFF_LOOP_BYTES)."""
    if len(raw) <= PARSE_OFF_LOOP_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def build_app(
    table: PoolTable,
    settings: GatewaySettings,
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
    demand_writer: DemandWriter | None = None,
    keys: KeyRing | None = None,
) -> Starlette:
    """``background``: coroutines that run for the app's life (the Kubernetes watches);
    ``demand_writer``: where held requests are recorded for the autoscaler (none: nowhere);
    ``keys``: the API keys (none: ``settings.api_key`` alone, or open without one)."""
    gateway = Gateway(table, settings, background, demand_writer, keys)
    app = Starlette(
        routes=gateway.routes(), lifespan=gateway.lifespan, exception_handlers=ROUTE_ERROR_HANDLERS
    )
    app.state.gateway = gateway
    return app
