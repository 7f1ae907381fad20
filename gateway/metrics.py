"""The gateway's Prometheus metrics, under the prefix ``llmpool_gateway:``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict

from llmpool.gateway.limits import TenantLimits
from llmpool.prometheus import Series

# Routing is a hash and a few comparisons; anything near a millisecond is worth seeing.
ROUTING_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.series = Series("llmpool_gateway")
        self._routing_series(self.series)
        self._bound_series(self.series)
        self._tenant_series(self.series)

    def _routing_series(self, series: Series) -> None:
        self.requests = series.counter(
            "requests",
            "Requests sent to a replica, by pool, replica and routing decision.",
            ["pool", "replica", "decision"],
        )
        self.rejected = series.counter(
            "rejected_requests",
            "Requests answered by the gateway itself, by reason (an OpenAI error code).",
            ["reason"],
        )
        self.upstream_errors = series.counter(
            "upstream_errors",
            "Failures talking to a replica: connect, unavailable (503) or stream (broken mid-way).",
            ["pool", "replica", "kind"],
        )
        self.routing_latency = series.histogram(
            "routing_latency_seconds",
            "Time to pick a replica, not counting time held waiting for one.",
            ROUTING_BUCKETS,
        )
        self.held_requests = series.gauge(
            "held_requests",
            "Requests waiting in the gateway for a pool to have a ready replica.",
            ["pool"],
        )
        self.in_flight = series.gauge(
            "in_flight_requests",
            "Requests this gateway has sent to a replica and not seen finish.",
            ["pool", "replica"],
        )

    def _bound_series(self, series: Series) -> None:
        self.requests_in_progress = series.gauge(
            "requests_in_progress",
            "Requests admitted and not yet answered to the end (bounded by --max-requests).",
        )
        self.buffered_body_bytes = series.gauge(
            "buffered_body_bytes",
            "Request-body bytes held until a replica's response begins (bounded by"
            " --max-buffered-body-mib).",
        )

    def _tenant_series(self, series: Series) -> None:
        # Per tenant: the tenant's name (from its key's Secret), never a key.
        self.tenant_requests = series.counter(
            "tenant_requests",
            "Requests of each tenant by outcome: admitted, or the error code that refused it.",
            ["tenant", "outcome"],
        )
        self.tenant_tokens = series.counter(
            "tenant_estimated_tokens",
            "Tokens reserved for each tenant at admission: body bytes / 4 + choices ×"
            " the output-token limit.",
            ["tenant"],
        )
        self.tenant_counted_tokens = series.counter(
            "tenant_counted_tokens",
            "Tokens each tenant's budget was finally charged: the usage an engine returned, or"
            " (without one) the prompt estimate for an engine's 4xx, 0 for the gateway's own"
            " answers, the reservation otherwise.",
            ["tenant"],
        )
        self.tenant_usage_tokens = series.counter(
            "tenant_usage_tokens",
            "Tokens the engines reported in each tenant's responses, by kind (prompt, completion).",
            ["tenant", "kind"],
        )
        self.tenant_in_flight = series.gauge(
            "tenant_in_flight_requests",
            "Each tenant's admitted requests not yet answered to the end.",
            ["tenant"],
        )
        self.replicas = series.gauge(
            "replicas",
            "Gateway replicas behind the Service (--replicas, the chart's gateway.replicas): each"
            " enforces every tenant limit on its own.",
        )
        self.tenant_limit = series.gauge(
            "tenant_limit",
            "Each tenant's limits as one replica enforces them, by limit (max_concurrent,"
            " requests_per_minute, tokens_per_minute, max_held).",
            ["tenant", "limit"],
        )
        self.tenant_effective_limit = series.gauge(
            "tenant_effective_limit",
            "The most a tenant can get through all replicas: tenant_limit × replicas.",
            ["tenant", "limit"],
        )
        self.tenant_held = series.gauge(
            "tenant_held_requests",
            "Each tenant's requests waiting for a pool to have a ready replica.",
            ["tenant"],
        )

    def set_tenant_limits(self, tenants: Iterable[tuple[str, TenantLimits]], replicas: int) -> None:
        """The limits of the tenants known now (those of removed keys are dropped)."""
        self.replicas.set(replicas)
        for gauge in (self.tenant_limit, self.tenant_effective_limit):
            gauge.clear()
        for tenant, limits in tenants:
            for limit, value in asdict(limits).items():
                if value is not None:
                    self.tenant_limit.labels(tenant=tenant, limit=limit).set(value)
                    self.tenant_effective_limit.labels(tenant=tenant, limit=limit).set(
                        value * replicas
                    )

    def render(self) -> bytes:
        return self.series.render()
