"""Prometheus series as our servers export them (the engine's and the gateway's): one registry per
server, every name under the server's prefix, and no ``*_created`` series."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# vLLM turns these off too: a *_created series per counter is noise on every scrape.
disable_created_metrics()


class Series:
    """Makes a server's series: each named ``{prefix}:{name}`` and labelled with the server's
    ``labels`` (the engine's ``model_name``) before its own."""

    def __init__(self, prefix: str, labels: Sequence[str] = ()) -> None:
        self.registry = CollectorRegistry()
        self.prefix = prefix
        self.labels = tuple(labels)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self._name(name), doc, self._labels(labels), registry=self.registry)

    def gauge(
        self, name: str, doc: str, labels: Sequence[str] = (), prefix: str | None = None
    ) -> Gauge:
        """``prefix``: another one than the server's (the engine's gauges under vLLM's names)."""
        return Gauge(
            f"{prefix or self.prefix}:{name}", doc, self._labels(labels), registry=self.registry
        )

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        return Histogram(
            self._name(name), doc, self._labels(labels), buckets=buckets, registry=self.registry
        )

    def render(self) -> bytes:
        """The text exposition ``GET /metrics`` serves."""
        return generate_latest(self.registry)

    def _name(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def _labels(self, labels: Sequence[str]) -> list[str]:
        return [*self.labels, *labels]
