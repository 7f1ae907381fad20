"""The act step of a reconcile pass: carry out a ``Plan`` with API calls and Events, nothing more.

Two answers only the API server has can change the plan after it is made, and both make the
pass plan again (``plan`` is pure and cheap) with the answer as one more input: an object the
pool does not control in the way of a child it applies (read before anything is applied, so no
pool is half-applied), and the API server refusing a child (422), remembered in the pool's state
so that the same spec is not sent again every pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import kopf
from kubernetes.client import ApiException

from llmpool.load import DEMAND_GATEWAYS_FIELD
from llmpool.operator import admission, kube, metrics, naming, ownership
from llmpool.operator.children import ChildView
from llmpool.operator.conditions import Event
from llmpool.operator.observe import APPLY_RETRY_SECONDS
from llmpool.operator.plan import ChildApply, Observed, Plan, PoolObject, plan
from llmpool.operator.pool_state import PoolState, Rejection
from llmpool.operator.views import DELETION_COST_ANNOTATION

logger = logging.getLogger(__name__)

Remember = Callable[[PoolState], None]  # keeps a pool's next state (in its kopf memo)


class ChildRejected(Exception):
    """The API server refused a rendered child (422): retrying the same spec cannot help."""


@dataclass(frozen=True)
class Pass:
    """One pass's inputs, kept to plan again with one more answer, and where it reports."""

    body: kopf.Body  # the live pool: what Events are about
    pool: PoolObject
    observed: Observed
    state: PoolState
    policy: admission.Policy
    remember: Remember  # also called when a call fails midway, with what was applied by then

    def plan(self, observed: Observed, state: PoolState) -> Plan:
        return plan(self.pool, observed, state, policy=self.policy)

    def post(self, events: Sequence[Event]) -> None:
        for event in events:
            kopf.event(self.body, type=event.type, reason=event.reason, message=event.message)


async def act(run: Pass, planned: Plan) -> None:
    """Carry out ``planned``, the plan of ``run``, in its order."""
    pool = run.pool
    run.remember(planned.state)
    await write_deletion_costs(pool.namespace, planned.deletion_costs)
    planned = await apply_children(run, planned)
    run.remember(planned.state)
    run.post(planned.events)
    if planned.status_patch:
        await kube.patch_pool_status(pool.namespace, pool.name, planned.status_patch)
    run.post(planned.transition_events)
    set_metrics(pool, planned)
    for pod, uid in planned.pods_to_delete:
        if await kube.delete_pod(pool.namespace, pod, uid):
            metrics.RECREATED_PODS.labels(pool.namespace, pool.name).inc()
            run.post([Event("Warning", "RecreatingDriftedPod", f"deleted drifted pod {pod}")])
    await prune_demand(pool.namespace, pool.name, planned.stale_demand)


async def write_deletion_costs(namespace: str, costs: Mapping[str, str]) -> None:
    for pod, cost in costs.items():
        try:
            await kube.annotate_pod(namespace, pod, {DELETION_COST_ANNOTATION: cost})
        except ApiException as error:
            logger.warning(
                "%s: setting the deletion cost of pod %s failed: %s", namespace, pod, error
            )


async def apply_children(run: Pass, planned: Plan) -> Plan:
    """Apply the plan's children in order, each ``*Restored`` warning right after its child;
    the plan to go on with (planned again when a conflict or a rejection blocked the apply)."""
    if not planned.children:
        return planned
    pool, observed = run.pool, run.observed
    conflicts = await find_conflicts(pool.uid, pool.namespace, planned.children, observed.children)
    if conflicts:
        blocked = replace(observed, conflict=ownership.conflict_message(conflicts))
        return run.plan(blocked, run.state)
    applied = planned.state
    try:
        for child in planned.children:
            await apply(child.body)
            if child.restored:
                run.post([Event("Warning", f"{child.body['kind']}Restored", child.restored)])
        run.post(planned.applied_events)
    except ChildRejected as error:
        assert planned.digest is not None  # children are only rendered with a pin
        rejected = Rejection(pool.generation, planned.digest, str(error))
        return run.plan(
            observed, replace(run.state, rejected=rejected, applied_at=time.monotonic())
        )
    finally:
        run.remember(replace(applied, applied_at=time.monotonic()))
    return replace(planned, state=replace(applied, applied_at=time.monotonic()))


async def find_conflicts(
    uid: str, namespace: str, due: Sequence[ChildApply], live: Mapping[str, ChildView]
) -> list[ownership.Conflict]:
    """Children about to be applied over an object the pool does not control. One the indexes
    show under the pool's controller reference needs no look; any other is read by name."""
    found = []
    for child in due:
        kind, name = child.body["kind"], child.body["metadata"]["name"]
        view = live.get(f"{kind}/{name}")
        if view is not None and ownership.controlled_by(view.body["metadata"], uid):
            continue
        try:
            metadata = await kube.read_metadata(kind, namespace, name)
        except ApiException as error:
            raise kopf.TemporaryError(
                f"reading {kind} {name}: {error.status} {error.reason}", delay=APPLY_RETRY_SECONDS
            ) from error
        conflict = ownership.conflict(kind, metadata, uid)
        if conflict is not None:
            found.append(conflict)
    return found


async def apply(child: dict[str, Any]) -> None:
    try:
        await kube.apply(child)
    except ApiException as error:
        what = f"the API server rejected {child['kind']} {child['metadata']['name']}"
        if error.status == 422:
            raise ChildRejected(f"{what}: {kube.error_message(error)}") from error
        raise kopf.TemporaryError(
            f"applying {child['kind']} {child['metadata']['name']}: {error.status} {error.reason}",
            delay=APPLY_RETRY_SECONDS,
        ) from error


def set_metrics(pool: PoolObject, planned: Plan) -> None:
    values, labels = planned.metrics, (pool.namespace, pool.name)
    if values.scaled is not None:
        metrics.SCALINGS.labels(*labels, values.scaled).inc()
    metrics.READY_REPLICAS.labels(*labels).set(values.ready_replicas)
    metrics.DESIRED_REPLICAS.labels(*labels).set(values.desired_replicas)
    if values.load is not None:
        metrics.POOL_LOAD.labels(*labels).set(values.load)
    if values.drifted_replicas is not None:
        metrics.DRIFTED_REPLICAS.labels(*labels).set(values.drifted_replicas)


async def prune_demand(namespace: str, name: str, replicas: list[str]) -> None:
    """Remove the records of gateway replicas long gone (their pods' names never come back)."""
    if not replicas:
        return
    patch = {DEMAND_GATEWAYS_FIELD: dict.fromkeys(replicas)}
    try:
        await kube.patch_demand_status(namespace, naming.demand_name(name), patch)
    except ApiException as error:
        logger.warning("%s/%s: pruning demand records failed: %s", namespace, name, error)
