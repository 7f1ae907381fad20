"""The load signal that the gateway routes on and the operator's autoscaler sizes pools by.

Defined once here so that both read a replica the same way: a replica's load is the requests it
holds, running plus waiting, from its engine's ``/metrics``; a pool's demand is the sum over its
replicas plus the requests a gateway holds for it because no replica is ready. The gateway
records what it holds on the LLMPool as the ``llmpool.dev/demand`` annotation (see ``Demand``),
which is how a pool at zero replicas is seen to have demand at all.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# The engine's gauges (engine/server/metrics.py) and the field of the load each one fills.
ENGINE_GAUGES = {
    "llmpool:num_requests_running": "running",
    "llmpool:num_requests_waiting": "waiting",
    "llmpool:kv_cache_usage_perc": "kv_cache_usage",
}

DEMAND_ANNOTATION = "llmpool.dev/demand"
# A gateway refreshes the annotation at least this often while it holds requests for the pool;
# the operator ignores a record older than DEMAND_TTL_SECONDS (a gateway that went away).
DEMAND_REFRESH_SECONDS = 5.0
DEMAND_TTL_SECONDS = 3 * DEMAND_REFRESH_SECONDS


def parse_engine_gauges(text: str) -> dict[str, float]:
    """The load gauges from an engine's ``/metrics`` text, summed over label sets."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = ENGINE_GAUGES.get(sample.name)
            if field is not None:
                values[field] = values.get(field, 0.0) + sample.value
    return values


def replica_load(running: float, waiting: float) -> float:
    """Requests on one replica by its own gauges: running plus waiting."""
    return running + waiting


def _utc(moment: float) -> str:
    return datetime.datetime.fromtimestamp(moment, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Demand:
    """Requests a gateway held for a pool, and when it counted them (unix seconds)."""

    held: int
    at: float

    def to_annotation(self) -> str:
        return json.dumps({"held": self.held, "at": _utc(self.at)}, separators=(",", ":"))

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str] | None) -> Demand | None:
        """The recorded demand, or None when absent or unreadable (never an error: it is a hint)."""
        raw = (annotations or {}).get(DEMAND_ANNOTATION)
        if not raw:
            return None
        try:
            record = json.loads(raw)
            at = datetime.datetime.strptime(record["at"], "%Y-%m-%dT%H:%M:%SZ")
            held = int(record["held"])
        except (ValueError, KeyError, TypeError):
            return None
        return cls(held=max(held, 0), at=at.replace(tzinfo=datetime.UTC).timestamp())

    def held_at(self, now: float) -> int:
        """The held count if the record is fresh at ``now``, else 0."""
        return self.held if now - self.at <= DEMAND_TTL_SECONDS else 0
