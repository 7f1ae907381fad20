"""The operator's kopf indexes: each pool's pods, Deployment, children and demand records, and
every pool's claim on a served name, kept up to date from watches (no API reads per pass).

kopf passes every index to every handler as a keyword argument named by the index's id; the ids
are the constants below, and ``indexed`` turns them into one pool's typed ``Indexed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from llmpool import names
from llmpool.load import Demand, demand_records
from llmpool.operator import children, naming
from llmpool.operator.spec import PoolSpec
from llmpool.operator.views import DeploymentView, PodView, deployment_view, pod_view

ENGINE_PODS = "engine_pods"
ENGINE_DEPLOYMENTS = "engine_deployments"
GATEWAY_DEMANDS = "gateway_demands"
POOLS_BY_SERVED_NAME = "pools_by_served_name"
# One index of live children per kind the operator renders: (group, version, plural).
CHILD_INDEXES: Mapping[str, tuple[str, ...]] = {
    "child_configmaps": ("v1", "configmaps"),
    "child_secrets": ("v1", "secrets"),
    "child_services": ("v1", "services"),
    "child_disruption_budgets": ("policy", "v1", "poddisruptionbudgets"),
    "child_deployments": ("apps", "v1", "deployments"),
    "child_demands": (naming.GROUP, naming.VERSION, naming.DEMAND_PLURAL),
}
CHILD_WATCH_LABELS: Mapping[str, Any] = {
    naming.POOL_LABEL: kopf.PRESENT,
    naming.MANAGED_BY_LABEL: naming.FIELD_MANAGER,
}

PoolKey = tuple[str | None, str]  # (namespace, pool name)


@kopf.index("v1", "pods", id=ENGINE_PODS, labels={naming.POOL_LABEL: kopf.PRESENT})
def engine_pods(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[PoolKey, PodView]:
    return {(namespace, labels[naming.POOL_LABEL]): pod_view(body)}


@kopf.index("apps", "v1", "deployments", id=ENGINE_DEPLOYMENTS, labels=CHILD_WATCH_LABELS)
def engine_deployments(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[PoolKey, DeploymentView]:
    return {(namespace, labels[naming.POOL_LABEL]): deployment_view(body)}


def live_child(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[PoolKey, children.ChildView]:
    return {(namespace, labels[naming.POOL_LABEL]): children.child_view(body)}


for _index_id, _resource in CHILD_INDEXES.items():
    kopf.index(*_resource, id=_index_id, labels=CHILD_WATCH_LABELS)(live_child)


@kopf.index(
    naming.GROUP,
    naming.VERSION,
    naming.DEMAND_PLURAL,
    id=GATEWAY_DEMANDS,
    labels=CHILD_WATCH_LABELS,
)
def gateway_demands(
    namespace: str | None, labels: Mapping[str, str], status: kopf.Status, **_: Any
) -> dict[PoolKey, dict[str, Demand]]:
    return {(namespace, labels[naming.POOL_LABEL]): demand_records(status)}


@kopf.index(naming.GROUP, naming.VERSION, naming.PLURAL, id=POOLS_BY_SERVED_NAME)
def pools_by_served_name(
    namespace: str | None, name: str | None, spec: kopf.Spec, **_: Any
) -> dict[str, tuple[str | None, str | None]]:
    """Keyed by the served name's normal form (``llmpool.names.normalize``): ``Chat`` and
    ``chat`` are one name to the gateway, so one claim here."""
    try:
        served = PoolSpec.from_dict(spec).served_name
    except (KeyError, TypeError):
        return {}  # not a pool the operator can serve: it claims nothing
    return {names.normalize(served): (namespace, name)}


@dataclass(frozen=True)
class Indexed:
    """What the indexes hold for one pool: its pods, its Deployment, its live children, the
    gateways' demand records, and every pool's claim on a served name."""

    pods: list[PodView]
    deployment: DeploymentView | None
    children: dict[str, children.ChildView] = field(default_factory=dict)  # by kind and name
    demand: dict[str, Demand] = field(default_factory=dict)  # by gateway replica
    # Every pool's (namespace, name) by normalised served name: kopf's index itself, not a copy.
    served_name_claims: Mapping[str, Iterable[tuple[str, str]]] = field(default_factory=dict)


def indexed(key: tuple[str, str], indexes: Mapping[str, Any]) -> Indexed:
    """One pool's part of the indexes kopf passed to a handler (as ``**kwargs``)."""
    live: dict[str, children.ChildView] = {}
    for index_id in CHILD_INDEXES:
        for view in indexes[index_id].get(key, []):
            live[f"{view.kind}/{view.name}"] = view
    return Indexed(
        pods=list(indexes[ENGINE_PODS].get(key, [])),
        deployment=next(iter(indexes[ENGINE_DEPLOYMENTS].get(key, [])), None),
        children=live,
        demand=next(iter(indexes[GATEWAY_DEMANDS].get(key, [])), {}),
        served_name_claims=indexes[POOLS_BY_SERVED_NAME],
    )
