"""The gateway's Prometheus metrics, under the prefix ``llmpool_gateway:``."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# As the engine does: a *_created series per counter is noise on every scrape.
disable_created_metrics()

# Routing is a hash and a few comparisons; anything near a millisecond is worth seeing.
ROUTING_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "llmpool_gateway:requests",
            "Requests sent to a replica, by pool, replica and routing decision.",
            ["pool", "replica", "decision"],
            registry=registry,
        )
        self.rejected = Counter(
            "llmpool_gateway:rejected_requests",
            "Requests answered by the gateway itself, by reason (an OpenAI error code).",
            ["reason"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "llmpool_gateway:upstream_errors",
            "Failures talking to a replica: connect, unavailable (503) or stream (broken mid-way).",
            ["pool", "replica", "kind"],
            registry=registry,
        )
        self.routing_latency = Histogram(
            "llmpool_gateway:routing_latency_seconds",
            "Time to pick a replica, not counting time held waiting for one.",
            buckets=ROUTING_BUCKETS,
            registry=registry,
        )
        self.held_requests = Gauge(
            "llmpool_gateway:held_requests",
            "Requests waiting in the gateway for a pool to have a ready replica.",
            ["pool"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "llmpool_gateway:in_flight_requests",
            "Requests this gateway has sent to a replica and not seen finish.",
            ["pool", "replica"],
            registry=registry,
        )

        self.requests_in_progress = Gauge(
            "llmpool_gateway:requests_in_progress",
            "Requests admitted and not yet answered to the end (bounded by --max-requests).",
            registry=registry,
        )
        self.buffered_body_bytes = Gauge(
            "llmpool_gateway:buffered_body_bytes",
            "Request-body bytes held until a replica's response begins (bounded by"
            " --max-buffered-body-mib).",
            registry=registry,
        )
        # Per tenant: the tenant's name (from its key's Secret), never a key.
        self.tenant_requests = Counter(
            "llmpool_gateway:tenant_requests",
            "Requests of each tenant by outcome: admitted, or the error code that refused it.",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.tenant_tokens = Counter(
            "llmpool_gateway:tenant_estimated_tokens",
            "Tokens counted against each tenant at admission: body bytes / 4 + choices ×"
            " max_tokens.",
            ["tenant"],
            registry=registry,
        )
        self.tenant_in_flight = Gauge(
            "llmpool_gateway:tenant_in_flight_requests",
            "Each tenant's admitted requests not yet answered to the end.",
            ["tenant"],
            registry=registry,
        )
        self.tenant_held = Gauge(
            "llmpool_gateway:tenant_held_requests",
            "Each tenant's requests waiting for a pool to have a ready replica.",
            ["tenant"],
            registry=registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
