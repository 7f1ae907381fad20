"""The routing table: LLMPools and the ready replicas behind each pool's Service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmpool.operator import adapters, conditions, naming
from llmpool.operator.spec import PoolSpec

SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set by Kubernetes on every EndpointSlice

PoolKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Replica:
    """One engine pod as the gateway reaches it; ``name`` is the pod's (what status.drift names)."""

    name: str
    url: str


@dataclass(frozen=True)
class Pool:
    namespace: str
    name: str
    served_name: str
    priority_class: str
    ready: bool  # the Ready condition; a pool that is not Ready may still have ready replicas
    pinned_digest: str | None
    drifted: frozenset[str]  # pods listed in status.drift for anything but an adapter
    scales_from_zero: bool = False  # autoscaling.minReplicas 0: a held request brings a replica
    # status.outgoing: pods of an older template during a rollout -> the digest that template pins
    outgoing: Mapping[str, str] = field(default_factory=dict)
    adapters: Mapping[str, str] = field(default_factory=dict)  # spec.adapters: name -> revision
    # (pod, adapter) of status.drift entries for ``adapters.<name>``: that adapter only is off
    adapter_drift: frozenset[tuple[str, str]] = frozenset()

    @property
    def key(self) -> PoolKey:
        return (self.namespace, self.name)

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"


def pool_from_object(obj: Mapping[str, Any]) -> Pool:
    """A pool from an LLMPool object as the API server returns it (defaults as the CRD's)."""
    metadata = obj["metadata"]
    spec = PoolSpec.from_dict(obj["spec"])
    status = obj.get("status") or {}
    ready = conditions.find(status.get("conditions") or [], conditions.READY)
    drift = [entry for entry in status.get("drift") or [] if "pod" in entry]
    return Pool(
        namespace=metadata["namespace"],
        name=metadata["name"],
        served_name=spec.served_name,
        priority_class=spec.priority_class,
        ready=ready is not None and ready.get("status") == "True",
        scales_from_zero=spec.autoscaling is not None and spec.autoscaling.min_replicas == 0,
        pinned_digest=status.get("pinnedDigest"),
        drifted=frozenset(e["pod"] for e in drift if _drifted_adapter(e) is None),
        outgoing={
            entry["pod"]: entry["pinnedDigest"]
            for entry in status.get("outgoing") or []
            if "pod" in entry and "pinnedDigest" in entry
        },
        adapters={adapter.name: adapter.revision for adapter in spec.adapters},
        adapter_drift=frozenset(
            (e["pod"], name) for e in drift if (name := _drifted_adapter(e)) is not None
        ),
    )


def _drifted_adapter(entry: Mapping[str, Any]) -> str | None:
    """The adapter a status.drift entry is about (field ``adapters.<name>``), else None: a pod
    whose adapter drifted still serves the base model and its other adapters."""
    field_name = entry.get("field")
    if isinstance(field_name, str) and field_name.startswith(adapters.FIELD_PREFIX):
        return field_name.removeprefix(adapters.FIELD_PREFIX)
    return None


def serves_new_requests(endpoint: Mapping[str, Any]) -> bool:
    """Ready, serving and not terminating (an unset condition counts as the API says: ready and
    serving, not terminating). A terminating pod drains what it holds and takes nothing new."""
    conditions = endpoint.get("conditions") or {}
    return (
        conditions.get("ready") is not False
        and conditions.get("serving") is not False
        and conditions.get("terminating") is not True
    )


def replicas_from_slice(endpoint_slice: Mapping[str, Any]) -> list[Replica]:
    """The endpoints of an EndpointSlice that take new requests (``serves_new_requests``)."""
    ports = endpoint_slice.get("ports") or []
    port = next(
        (p["port"] for p in ports if p.get("name") == naming.ENGINE_PORT_NAME and p.get("port")),
        naming.ENGINE_PORT,
    )
    replicas = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        if not serves_new_requests(endpoint) or not endpoint.get("addresses"):
            continue
        address = endpoint["addresses"][0]
        host = f"[{address}]" if ":" in address else address
        pod = (endpoint.get("targetRef") or {}).get("name") or address
        replicas.append(Replica(name=pod, url=f"http://{host}:{port}"))
    return replicas


@dataclass(frozen=True)
class _Slice:
    namespace: str
    service: str
    replicas: tuple[Replica, ...]


class PoolTable:
    """Pools and EndpointSlices as last seen; changed only on the event loop's thread.

    ``wait_for_change`` lets a request held for a pool without replicas wake up when one appears.
    """

    def __init__(self) -> None:
        self._pools: dict[PoolKey, Pool] = {}
        self._slices: dict[PoolKey, _Slice] = {}  # (namespace, slice name) -> slice
        self._changed = asyncio.Event()
        self.synced = False  # True once the first lists are in; until then, every model is 404
        self._heard: dict[int, float] = {}  # watch loop -> when it last heard the API server

    # --- updates ------------------------------------------------------------------------------

    def set_pool(self, pool: Pool) -> None:
        self._pools[pool.key] = pool
        self._notify()

    def delete_pool(self, key: PoolKey) -> None:
        self._pools.pop(key, None)
        self._notify()

    def reset_pools(self, namespace: str | None, pools: Iterable[Pool]) -> None:
        """Replace the pools of ``namespace`` (None: of every namespace) after a re-list."""
        self._pools = {k: p for k, p in self._pools.items() if namespace not in (None, k[0])}
        self._pools.update((p.key, p) for p in pools)
        self._notify()

    def set_slice(self, endpoint_slice: Mapping[str, Any]) -> None:
        metadata = endpoint_slice["metadata"]
        service = (metadata.get("labels") or {}).get(SERVICE_NAME_LABEL)
        key = (metadata["namespace"], metadata["name"])
        if service is None:
            self._slices.pop(key, None)
        else:
            replicas = tuple(replicas_from_slice(endpoint_slice))
            self._slices[key] = _Slice(metadata["namespace"], service, replicas)
        self._notify()

    def delete_slice(self, key: PoolKey) -> None:
        self._slices.pop(key, None)
        self._notify()

    def reset_slices(self, namespace: str | None, slices: Iterable[Mapping[str, Any]]) -> None:
        self._slices = {k: s for k, s in self._slices.items() if namespace not in (None, k[0])}
        for endpoint_slice in slices:
            self.set_slice(endpoint_slice)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self) -> None:
        await self._changed.wait()

    def heard_from(self, source: int) -> None:
        """Watch loop ``source`` has just heard from the API server (a list, an event, a watch
        the server ended on time)."""
        self._heard[source] = time.monotonic()

    # --- queries ------------------------------------------------------------------------------

    def age(self) -> float:
        """Seconds since the stalest watch loop last heard from the API server; 0 for a table
        no loop feeds (filled by hand)."""
        if not self._heard:
            return 0.0
        return time.monotonic() - min(self._heard.values())

    def pool(self, key: PoolKey) -> Pool | None:
        return self._pools.get(key)

    def pools(self) -> list[Pool]:
        return sorted(self._pools.values(), key=lambda p: p.key)

    def replicas(self, pool: Pool) -> list[Replica]:
        """Ready replicas behind the pool's Service, each once, in a stable order."""
        service = naming.service_name(pool.name)
        found = {
            replica.url: replica
            for s in self._slices.values()
            if s.namespace == pool.namespace and s.service == service
            for replica in s.replicas
        }
        return sorted(found.values(), key=lambda r: r.url)

    def all_replicas(self) -> list[Replica]:
        return sorted(
            {r.url: r for pool in self._pools.values() for r in self.replicas(pool)}.values(),
            key=lambda r: r.url,
        )
