"""kopf handlers: read the cluster, call the pure functions, apply and report.

Importing this module registers the handlers with kopf's default registry.

- ``reconcile`` (create/update/resume) renders and server-side-applies the pool's children and
  records what they were rendered from (``status.pinnedDigest`` and friends).
- ``observe`` (a timer) turns the indexed Deployment and Pods into counts and conditions, and
  checks fingerprints every ``spec.drift.intervalSeconds`` or as soon as the pool's pods
  change (a pod restarting or turning ready), then applies the drift policy.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client import ApiException

from llmpool import pinning
from llmpool.operator import conditions, drift, fingerprints, kube, metrics, naming, render
from llmpool.operator import status as pool_status
from llmpool.operator.sizing import size_pool
from llmpool.operator.spec import PoolSpec
from llmpool.operator.views import DeploymentView, PodView, deployment_view, pod_view

logger = logging.getLogger(__name__)

STATUS_INTERVAL_SECONDS = 2.0
CHAT_TEMPLATE_RETRY_SECONDS = 15
APPLY_RETRY_SECONDS = 10
RESTORE_GRACE_SECONDS = 10
DELETION_POLLING_SECONDS = 1.0
DEFAULT_ENGINE_IMAGE = "llmpool:latest"
ANNOTATION_PREFIX = "llmpool.dev"


class ChatTemplateMissing(Exception):
    pass


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Least privilege: no watching of CRDs or namespaces (namespaces are exact names).
    settings.scanning.disabled = True
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"
    # The status schema is structural: kopf's own bookkeeping goes to annotations, not status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # Events come from our own kopf.event/kopf.warn calls; kopf's per-handler chatter (a
    # timer succeeding every few seconds) stays in the log. kopf.info would be filtered too.
    settings.posting.level = logging.WARNING
    # A pool being deleted keeps its finalizer until the `observe` timer's current run ends;
    # kopf re-checks that every cancellation_polling seconds (60 by default), so a delete
    # landing mid-run would hang `kubectl delete --wait` for a minute.
    settings.background.cancellation_polling = DELETION_POLLING_SECONDS
    # Watch only the engine pods and Deployments, filtered by the API server.
    settings.watching.label_selectors["v1", "pods"] = naming.POOL_LABEL
    settings.watching.label_selectors["apps", "v1", "deployments"] = naming.POOL_LABEL
    kube.load_credentials()
    if memo.get("peering_to_create"):
        await kube.ensure_peering(memo["peering_to_create"], list(memo.get("namespaces") or []))
    if memo.get("metrics_port"):
        metrics.serve(memo["metrics_port"])


@kopf.index("v1", "pods", labels={naming.POOL_LABEL: kopf.PRESENT})
def engine_pods(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], PodView]:
    return {(namespace, labels[naming.POOL_LABEL]): pod_view(body)}


@kopf.index(
    "apps",
    "v1",
    "deployments",
    labels={naming.POOL_LABEL: kopf.PRESENT, naming.MANAGED_BY_LABEL: naming.FIELD_MANAGER},
)
def engine_deployments(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], DeploymentView]:
    return {(namespace, labels[naming.POOL_LABEL]): deployment_view(body)}


async def read_chat_template(pool: PoolSpec, namespace: str) -> str | None:
    ref = pool.chat_template
    if ref is None:
        return None
    template = await kube.read_configmap_key(namespace, ref.name, ref.key)
    if template is None:
        raise ChatTemplateMissing(
            f"chat template ConfigMap {namespace}/{ref.name} with key {ref.key!r} not found"
        )
    return template


async def apply_children(
    body: kopf.Body, spec: Mapping[str, Any], chat_template: str | None, image: str
) -> tuple[dict[str, Any], str]:
    """Render and apply ConfigMap, Service and Deployment; return the pinned dict and digest."""
    name = body["metadata"]["name"]
    pool = PoolSpec.from_dict(spec)
    pinned = pinning.pinned_from_spec(spec, chat_template)
    digest = pinning.pinned_digest(pinned)
    children = [
        render.render_configmap(name, pinned, chat_template),
        render.render_service(name),
        render.render_deployment(name, pool, digest, image),
    ]
    kopf.adopt(children, owner=body)
    for child in children:
        try:
            await kube.apply(child)
        except ApiException as error:
            what = f"applying {child['kind']} {child['metadata']['name']}"
            if error.status == 422:
                raise kopf.PermanentError(f"{what}: {error.reason}: {error.body}") from error
            raise kopf.TemporaryError(
                f"{what}: {error.status} {error.reason}", delay=APPLY_RETRY_SECONDS
            ) from error
    return pinned, digest


def replica_change(diff: kopf.Diff) -> tuple[int, int] | None:
    """``(old, new)`` when an update changed spec.replicas (e.g. `kubectl scale llmpool`)."""
    for operation, field, old, new in diff:
        if operation == "change" and tuple(field) == ("spec", "replicas"):
            return old, new
    return None


def _changed_pinned_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [key for key in pinning.PINNED_KEYS if old.get(key) != new.get(key)]


async def _reconcile(
    body: kopf.Body, spec: Mapping[str, Any], status: Mapping[str, Any], memo: kopf.Memo
) -> dict[str, Any]:
    """Apply the children for the current spec and template; return the status patch."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    pool = PoolSpec.from_dict(spec)
    chat_template = await read_chat_template(pool, namespace)
    image = memo.get("engine_image") or DEFAULT_ENGINE_IMAGE
    pinned, digest = await apply_children(body, spec, chat_template, image)
    memo["applied_at"] = time.monotonic()
    sizing = size_pool(pool)
    for problem in sizing.problems:
        kopf.warn(body, reason="ImpossibleSpec", message=problem)

    previous_digest = status.get("pinnedDigest")
    if previous_digest is None:
        kopf.event(
            body, type="Normal", reason="Reconciled", message=f"engine pods pinned to {digest}"
        )
    elif previous_digest != digest:
        changed = _changed_pinned_fields(status.get("pinned") or {}, pinned) or ["digest"]
        message = f"pinned {', '.join(changed)} changed: rolling to {digest}"
        kopf.event(body, type="Normal", reason="RolloutStarted", message=message)
    new = pool_status.reconciled_status(
        pool=name,
        namespace=namespace,
        generation=body["metadata"].get("generation", 0),
        pinned=pinned,
        digest=digest,
        capacity=sizing.capacity,
    )
    return pool_status.status_patch(status, new)


@kopf.on.resume(naming.GROUP, naming.VERSION, naming.PLURAL)
@kopf.on.create(naming.GROUP, naming.VERSION, naming.PLURAL)
@kopf.on.update(naming.GROUP, naming.VERSION, naming.PLURAL)
async def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    diff: kopf.Diff,
    **_: Any,
) -> None:
    try:
        patch.status.update(await _reconcile(body, spec, status, memo))
        change = replica_change(diff)
        if change is not None:
            message = f"replicas {change[0]} -> {change[1]} (pods keep their template)"
            kopf.event(body, type="Normal", reason="Scaled", message=message)
    except ChatTemplateMissing as error:
        kopf.warn(body, reason="ChatTemplateNotFound", message=str(error))
        raise kopf.TemporaryError(str(error), delay=CHAT_TEMPLATE_RETRY_SECONDS) from error


@kopf.on.delete(naming.GROUP, naming.VERSION, naming.PLURAL, optional=True)
def forget(name: str, namespace: str | None, **_: Any) -> None:
    """Children go with the pool (owner references); only the metric series stay behind."""
    metrics.forget_pool(namespace or "", name)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pods_signature(pods: list[PodView]) -> tuple[tuple[str, bool, int], ...]:
    """Changes when a pod comes, goes, restarts or turns (un)ready: a reason to check now."""
    return tuple(sorted((p.uid, p.ready, p.restart_count) for p in pods))


def _restore_due(memo: kopf.Memo) -> bool:
    """Whether the last apply is old enough for a missing Deployment to be really missing."""
    return time.monotonic() - memo.get("applied_at", float("-inf")) >= RESTORE_GRACE_SECONDS


def _drift_check_due(memo: kopf.Memo, pool: PoolSpec, pods: list[PodView]) -> bool:
    signature = _pods_signature(pods)
    last_check = memo.get("last_drift_check", float("-inf"))
    due = signature != memo.get("pods_signature") or (
        time.monotonic() - last_check >= pool.drift_interval_seconds
    )
    if due:
        memo["pods_signature"] = signature
        memo["last_drift_check"] = time.monotonic()
    return due


async def _check_drift(
    *,
    body: kopf.Body,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    memo: kopf.Memo,
    pods: list[PodView],
    patch: kopf.Patch,
) -> tuple[list[drift.DriftEntry], int, str]:
    """Fingerprint the ready pods; re-render first if the user's chat template changed.

    Returns the drift entries, how many replicas answered, and the current digest.
    """
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    pool = PoolSpec.from_dict(spec)
    chat_template = await read_chat_template(pool, namespace)
    expected = pinning.pinned_from_spec(spec, chat_template)
    digest = pinning.pinned_digest(expected)
    if digest != status.get("pinnedDigest"):
        # The spec is unchanged (its generation was reconciled), so the template changed.
        patch.status.update(await _reconcile(body, spec, status, memo))

    report = await fingerprints.fetch_fingerprints(pods)
    for pod, why in report.unreachable.items():
        # Logged, not an Event: a pod on its way down would raise one every interval.
        metrics.FINGERPRINT_ERRORS.labels(namespace, name).inc()
        logger.warning("%s/%s: GET /fingerprint of pod %s failed: %s", namespace, name, pod, why)
    entries = drift.classify_drift(report.fingerprints, expected, digest)

    already_reported = {entry.get("pod") for entry in status.get("drift") or []}
    for entry in entries:
        if entry.pod not in already_reported:
            message = f"pod {entry.pod}: {entry.field} is {entry.actual}, expected {entry.expected}"
            kopf.warn(body, reason="DriftDetected", message=message)
    return entries, len(report.fingerprints), digest


async def _recreate_drifted(
    *,
    body: kopf.Body,
    spec: Mapping[str, Any],
    memo: kopf.Memo,
    entries: list[drift.DriftEntry],
    pods: list[PodView],
    digest: str,
    rollout: pool_status.Rollout,
) -> None:
    pool = PoolSpec.from_dict(spec)
    victims = drift.pods_to_recreate(
        entries,
        pods,
        digest=digest,
        replicas=pool.replicas,
        max_unavailable=pool.max_unavailable,
        rollout_in_progress=rollout.in_progress,
    )
    if not victims:
        return
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    # Restore the children first, so that the replacement mounts the pinned template again.
    chat_template = await read_chat_template(pool, namespace)
    await apply_children(
        body, spec, chat_template, memo.get("engine_image") or DEFAULT_ENGINE_IMAGE
    )
    uids = {p.name: p.uid for p in pods}
    for pod in victims:
        if await kube.delete_pod(namespace, pod, uids[pod]):
            metrics.RECREATED_PODS.labels(namespace, name).inc()
            kopf.warn(body, reason="RecreatingDriftedPod", message=f"deleted drifted pod {pod}")


# kopf passes indexes as keyword arguments named after them, beyond its typed protocol.
@kopf.timer(naming.GROUP, naming.VERSION, naming.PLURAL, interval=STATUS_INTERVAL_SECONDS)  # type: ignore[arg-type]
async def observe(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    patch: kopf.Patch,
    memo: kopf.Memo,
    engine_pods: kopf.Index[tuple[str, str], PodView],
    engine_deployments: kopf.Index[tuple[str, str], DeploymentView],
    **_: Any,
) -> None:
    digest = status.get("pinnedDigest")
    if not digest:
        return  # not reconciled yet
    name, namespace = meta["name"], meta["namespace"]
    pool = PoolSpec.from_dict(spec)
    key = (namespace, name)
    pods = list(engine_pods.get(key, []))
    deployment = next(iter(engine_deployments.get(key, [])), None)
    generation = meta.get("generation", 0)
    reconciled_generation = status.get("observedGeneration", 0)
    problems = list(size_pool(pool).problems)
    reconciled = reconciled_generation >= generation

    if deployment is None and reconciled and _restore_due(memo):
        # Someone deleted the engine Deployment: put it back (the index lags a fresh apply,
        # hence the grace period).
        kopf.warn(body, reason="DeploymentRestored", message="the engine Deployment was missing")
        try:
            patch.status.update(await _reconcile(body, spec, status, memo))
        except ChatTemplateMissing as error:
            problems.append(str(error))

    entries: list[drift.DriftEntry] | None = None
    checked = 0
    if reconciled and _drift_check_due(memo, pool, pods):
        try:
            entries, checked, digest = await _check_drift(
                body=body, spec=spec, status=status, memo=memo, pods=pods, patch=patch
            )
        except ChatTemplateMissing as error:
            problems.append(str(error))

    observation = pool_status.Observation(
        pool=name,
        revision=pool.revision,
        generation=generation,
        reconciled_generation=reconciled_generation,
        replicas=pool.replicas,
        digest=digest,
        deployment=deployment,
        pods=pods,
        problems=problems,
        drift=entries,
        checked_replicas=checked,
    )
    new = pool_status.compute_status(observation, status, now=_now())
    patch.status.update(pool_status.status_patch(status, new))
    for event in conditions.transition_events(status.get("conditions") or [], new["conditions"]):
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)

    metrics.READY_REPLICAS.labels(namespace, name).set(new["readyReplicas"])
    if entries is not None:
        metrics.DRIFTED_REPLICAS.labels(namespace, name).set(len(drift.drifted_pods(entries)))
        if entries and pool.drift_policy == "Recreate":
            rollout = pool_status.rollout_state(
                deployment,
                pods,
                digest=digest,
                replicas=pool.replicas,
                reconciled=reconciled,
            )
            await _recreate_drifted(
                body=body,
                spec=spec,
                memo=memo,
                entries=entries,
                pods=pods,
                digest=digest,
                rollout=rollout,
            )
