"""The load signal that the gateway routes on and the operator's autoscaler sizes pools by.

Defined once here so that both read a replica the same way: a replica's load is the requests it
holds, running plus waiting, from its engine's ``/metrics``; a pool's demand is the sum over its
replicas plus the requests the gateways hold for it because no replica is ready (or none is left
untried). Each gateway replica records what it holds in the status of the pool's
``LLMPoolDemand`` (same namespace and name), under its own name (see ``Demand``), which is how a
pool at zero replicas is seen to have demand at all. The gateways can write nothing else: not
the pool, not its spec.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# The engine's gauges (engine/server/metrics.py) and the field of the load each one fills.
ENGINE_GAUGES = {
    "llmpool:num_requests_running": "running",
    "llmpool:num_requests_waiting": "waiting",
    "llmpool:kv_cache_usage_perc": "kv_cache_usage",
}

# A gateway refreshes its record at least this often while it holds requests for the pool;
# the operator ignores a record older than DEMAND_TTL_SECONDS (a gateway that went away), one
# dated later than its own clock by more than DEMAND_CLOCK_SKEW_SECONDS (a record from the
# future would never expire), and prunes records older than DEMAND_PRUNE_SECONDS (gateway
# replicas long replaced).
DEMAND_REFRESH_SECONDS = 5.0
DEMAND_TTL_SECONDS = 3 * DEMAND_REFRESH_SECONDS
DEMAND_CLOCK_SKEW_SECONDS = DEMAND_REFRESH_SECONDS
DEMAND_PRUNE_SECONDS = 600.0
# The LLMPoolDemand status field that maps each gateway replica to its record.
DEMAND_GATEWAYS_FIELD = "gateways"
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


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
    return datetime.datetime.fromtimestamp(moment, datetime.UTC).strftime(_TIME_FORMAT)


@dataclass(frozen=True)
class Demand:
    """Requests a gateway replica held for a pool, and when it counted them (unix seconds)."""

    held: int
    at: float

    def to_record(self) -> dict[str, Any]:
        return {"held": self.held, "at": _utc(self.at)}

    @classmethod
    def from_record(cls, record: Any) -> Demand | None:
        """The recorded demand, or None when unreadable (never an error: it is a hint)."""
        try:
            at = datetime.datetime.strptime(record["at"], _TIME_FORMAT)
            held = int(record["held"])
        except (ValueError, KeyError, TypeError):
            return None
        return cls(held=max(held, 0), at=at.replace(tzinfo=datetime.UTC).timestamp())

    def held_at(self, now: float) -> int:
        """The held count if the record is fresh at ``now`` and not from its future, else 0."""
        age = now - self.at
        return self.held if -DEMAND_CLOCK_SKEW_SECONDS <= age <= DEMAND_TTL_SECONDS else 0


def demand_records(status: Mapping[str, Any] | None) -> dict[str, Demand]:
    """Each gateway replica's readable record in an LLMPoolDemand's status."""
    records = (status or {}).get(DEMAND_GATEWAYS_FIELD) or {}
    if not isinstance(records, Mapping):
        return {}
    readable = {replica: Demand.from_record(record) for replica, record in records.items()}
    return {replica: demand for replica, demand in readable.items() if demand is not None}


def held_for_pool(records: Mapping[str, Demand], now: float) -> int:
    """Requests the gateways hold for the pool now: the sum of their fresh records."""
    return sum(demand.held_at(now) for demand in records.values())


def stale_replicas(records: Mapping[str, Demand], now: float) -> list[str]:
    """Gateway replicas whose record is older than DEMAND_PRUNE_SECONDS: to be removed."""
    return sorted(r for r, demand in records.items() if now - demand.at > DEMAND_PRUNE_SECONDS)
