"""kopf handlers: read the cluster, call the pure functions, apply and report.

Importing this module registers the handlers with kopf's default registry.

There is one reconcile path, ``converge``, level-triggered and serialized per pool: the
create/update/resume handler, the ``observe`` timer (every ``STATUS_INTERVAL_SECONDS``) and a
change of the pool's LLMPoolDemand (a gateway holding requests) all call it under the pool's
lock, and it decides only from the live LLMPool it reads under that lock, so a timer started
with an older body can never write children or status of an older spec. Each pass re-applies
every child when the spec (or the user's chat template) changed, and otherwise each child that
is missing or differs from what the spec renders, never over an object the pool does not
control (``ownership``); then it turns
the indexed Deployment and Pods into counts and conditions, checks fingerprints every
``spec.drift.intervalSeconds`` (or as soon as the pool's pods change) and applies the drift
policy, backing off after the operator's ``max_drift_recreations``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import kopf
from kubernetes.client import ApiException

from llmpool import pinning
from llmpool.fleet_key import FleetKey
from llmpool.load import DEMAND_GATEWAYS_FIELD, Demand, demand_records, stale_replicas
from llmpool.operator import (
    adapters,
    admission,
    autoscaling,
    children,
    conditions,
    drift,
    fingerprints,
    kube,
    metrics,
    naming,
    ownership,
    render,
    served_names,
)
from llmpool.operator import status as pool_status
from llmpool.operator.pool_load import deletion_costs, pool_demand, replica_loads
from llmpool.operator.sizing import size_pool
from llmpool.operator.spec import PoolSpec
from llmpool.operator.views import (
    DELETION_COST_ANNOTATION,
    DeploymentView,
    PodView,
    deployment_view,
    owned_pods,
    pod_view,
)

logger = logging.getLogger(__name__)

STATUS_INTERVAL_SECONDS = 2.0
APPLY_RETRY_SECONDS = 10
# The indexes lag a fresh apply by a moment: a child is not "missing" or "different" until the
# operator's own last apply is this old.
RESTORE_GRACE_SECONDS = 5
DELETION_POLLING_SECONDS = 1.0
WATCH_SERVER_TIMEOUT_SECONDS = 60
WATCH_CLIENT_SLACK_SECONDS = 15
API_CONNECT_TIMEOUT_SECONDS = 5
API_REQUEST_TIMEOUT_SECONDS = 30
DEFAULT_ENGINE_IMAGE = "llmpool:latest"
ANNOTATION_PREFIX = "llmpool.dev"
APPLY_REJECTED = "ApplyRejected"
OWNERSHIP_CONFLICT = "OwnershipConflict"
CHILD_WATCH_LABELS: Mapping[str, Any] = {
    naming.POOL_LABEL: kopf.PRESENT,
    naming.MANAGED_BY_LABEL: naming.FIELD_MANAGER,
}


class ChatTemplateMissing(Exception):
    pass


class ChildRejected(Exception):
    """The API server refused a rendered child (422): retrying the same spec cannot help."""


class ChildConflict(Exception):
    """An object of a child's name exists that the pool does not control: nothing is applied."""


@dataclass(frozen=True)
class PoolHandle:
    """What a handler of another resource needs to run a pool's ``converge``."""

    uid: str
    memo: kopf.Memo


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
    # Every watch ends on the server after WATCH_SERVER_TIMEOUT_SECONDS and is resumed; one
    # silently dropped (no FIN from a vanished API server) is ended by the client timeout, and
    # every other request is bounded too.
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_SECONDS
    settings.watching.client_timeout = WATCH_SERVER_TIMEOUT_SECONDS + WATCH_CLIENT_SLACK_SECONDS
    settings.watching.connect_timeout = API_CONNECT_TIMEOUT_SECONDS
    settings.networking.request_timeout = API_REQUEST_TIMEOUT_SECONDS
    settings.networking.connect_timeout = API_CONNECT_TIMEOUT_SECONDS
    # Watch only the pools' own children, filtered by the API server.
    settings.watching.label_selectors["v1", "pods"] = naming.POOL_LABEL
    settings.watching.label_selectors["apps", "v1", "deployments"] = naming.POOL_LABEL
    settings.watching.label_selectors["v1", "services"] = naming.POOL_LABEL
    settings.watching.label_selectors["v1", "configmaps"] = naming.POOL_LABEL
    settings.watching.label_selectors["v1", "secrets"] = naming.POOL_LABEL
    settings.watching.label_selectors[naming.GROUP, naming.VERSION, naming.DEMAND_PLURAL] = (
        naming.POOL_LABEL
    )
    settings.watching.label_selectors["policy", "v1", "poddisruptionbudgets"] = naming.POOL_LABEL
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


@kopf.index("apps", "v1", "deployments", labels=CHILD_WATCH_LABELS)
def engine_deployments(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], DeploymentView]:
    return {(namespace, labels[naming.POOL_LABEL]): deployment_view(body)}


@kopf.index("apps", "v1", "deployments", labels=CHILD_WATCH_LABELS)
def child_deployments(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], children.ChildView]:
    return {(namespace, labels[naming.POOL_LABEL]): children.child_view(body)}


@kopf.index("v1", "services", labels=CHILD_WATCH_LABELS)
def child_services(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], children.ChildView]:
    return {(namespace, labels[naming.POOL_LABEL]): children.child_view(body)}


@kopf.index("v1", "configmaps", labels=CHILD_WATCH_LABELS)
def child_configmaps(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], children.ChildView]:
    return {(namespace, labels[naming.POOL_LABEL]): children.child_view(body)}


@kopf.index("policy", "v1", "poddisruptionbudgets", labels=CHILD_WATCH_LABELS)
def child_disruption_budgets(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], children.ChildView]:
    return {(namespace, labels[naming.POOL_LABEL]): children.child_view(body)}


@kopf.index("v1", "secrets", labels=CHILD_WATCH_LABELS)
def child_secrets(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], children.ChildView]:
    return {(namespace, labels[naming.POOL_LABEL]): children.child_view(body)}


@kopf.index(naming.GROUP, naming.VERSION, naming.DEMAND_PLURAL, labels=CHILD_WATCH_LABELS)
def child_demands(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], children.ChildView]:
    return {(namespace, labels[naming.POOL_LABEL]): children.child_view(body)}


@kopf.index(naming.GROUP, naming.VERSION, naming.DEMAND_PLURAL, labels=CHILD_WATCH_LABELS)
def gateway_demands(
    namespace: str | None, labels: Mapping[str, str], status: kopf.Status, **_: Any
) -> dict[tuple[str | None, str], dict[str, Demand]]:
    return {(namespace, labels[naming.POOL_LABEL]): demand_records(status)}


@kopf.index(naming.GROUP, naming.VERSION, naming.PLURAL)
def pools_by_served_name(
    namespace: str | None, name: str | None, spec: kopf.Spec, **_: Any
) -> dict[str, tuple[str | None, str | None]]:
    try:
        served = PoolSpec.from_dict(spec).served_name
    except (KeyError, TypeError):
        return {}  # not a pool the operator can serve: it claims nothing
    return {served: (namespace, name)}


@dataclass(frozen=True)
class Observed:
    """What the indexes hold for one pool: its pods, its Deployment, its live children, the
    gateways' demand records, and every pool's claim on a served name."""

    pods: list[PodView]
    deployment: DeploymentView | None
    children: dict[str, children.ChildView] = field(default_factory=dict)  # by kind and name
    demand: dict[str, Demand] = field(default_factory=dict)  # by gateway replica
    # Every pool's (namespace, name) by served name: kopf's index itself, not a copy.
    served_name_claims: Mapping[str, Iterable[tuple[str, str]]] = field(default_factory=dict)


def observed_from_indexes(key: tuple[str, str], **indexes: Any) -> Observed:
    live: dict[str, children.ChildView] = {}
    for index in (
        "child_configmaps",
        "child_secrets",
        "child_services",
        "child_disruption_budgets",
        "child_deployments",
        "child_demands",
    ):
        for view in indexes[index].get(key, []):
            live[f"{view.kind}/{view.name}"] = view
    return Observed(
        pods=list(indexes["engine_pods"].get(key, [])),
        deployment=next(iter(indexes["engine_deployments"].get(key, [])), None),
        children=live,
        demand=next(iter(indexes["gateway_demands"].get(key, [])), {}),
        served_name_claims=indexes["pools_by_served_name"],
    )


def _policy(memo: kopf.Memo) -> admission.Policy:
    policy = memo.get("policy")
    if isinstance(policy, admission.Policy):
        return policy
    return admission.Policy.default(memo.get("engine_image") or DEFAULT_ENGINE_IMAGE)


def _pool_lock(memo: kopf.Memo) -> asyncio.Lock:
    """The pool's reconcile lock (kopf's memo is per object and shared by its handlers)."""
    lock = memo.get("reconcile_lock")
    if lock is None:
        lock = memo["reconcile_lock"] = asyncio.Lock()
    return lock


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pods_signature(pods: list[PodView]) -> tuple[tuple[str, bool, int], ...]:
    """Changes when a pod comes, goes, restarts or turns (un)ready: a reason to check now."""
    return tuple(sorted((p.uid, p.ready, p.restart_count) for p in pods))


def _restore_due(memo: kopf.Memo) -> bool:
    """Whether the last apply is old enough for the indexes to show what it wrote."""
    return time.monotonic() - memo.get("applied_at", float("-inf")) >= RESTORE_GRACE_SECONDS


def _drift_check_due(memo: kopf.Memo, pool: PoolSpec, pods: list[PodView]) -> bool:
    """Every drift interval, and at once when the pods or the adapters of the spec change (the
    check is where adapters are loaded and unloaded)."""
    signature = (_pods_signature(pods), pool.lora_settings, pool.adapters)
    last_check = memo.get("last_drift_check", float("-inf"))
    due = signature != memo.get("pods_signature") or (
        time.monotonic() - last_check >= pool.drift_interval_seconds
    )
    if due:
        memo["pods_signature"] = signature
        memo["last_drift_check"] = time.monotonic()
    return due


def replica_change(diff: kopf.Diff) -> tuple[int, int] | None:
    """``(old, new)`` when an update changed spec.replicas (e.g. `kubectl scale llmpool`)."""
    for operation, field_path, old, new in diff:
        if operation == "change" and tuple(field_path) == ("spec", "replicas"):
            return old, new
    return None


def _changed_pinned_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [key for key in pinning.PINNED_KEYS if old.get(key) != new.get(key)]


async def read_chat_template(
    pool: PoolSpec, namespace: str, memo: kopf.Memo, fresh: bool
) -> str | None:
    """The user's template; re-read only when ``fresh`` (else the last one read, if any)."""
    ref = pool.chat_template
    if ref is None:
        return None
    cached = memo.get("chat_template")
    if not fresh and cached is not None and cached[0] == ref:
        return str(cached[1])
    template = await kube.read_configmap_key(namespace, ref.name, ref.key)
    if template is None:
        raise ChatTemplateMissing(
            f"chat template ConfigMap {namespace}/{ref.name} with key {ref.key!r} not found"
        )
    memo["chat_template"] = (ref, template)
    return template


def _engine_key(memo: kopf.Memo, namespace: str, name: str) -> str | None:
    """The pool's engine key from the fleet key; None in open mode (no fleet key configured)."""
    fleet = memo.get("fleet_key")
    if not isinstance(fleet, FleetKey):
        return None
    try:
        return fleet.engine_key(namespace, name)
    except (OSError, ValueError) as error:
        raise kopf.TemporaryError(
            f"reading the fleet key: {error}", delay=APPLY_RETRY_SECONDS
        ) from error


async def _conflicts(
    uid: str, namespace: str, due: list[tuple[dict[str, Any], str]], observed: Observed
) -> list[ownership.Conflict]:
    """Children about to be applied over an object the pool does not control. One the indexes
    show under the pool's controller reference needs no look; any other is read by name."""
    found = []
    for child, _ in due:
        kind, name = child["kind"], child["metadata"]["name"]
        live = observed.children.get(f"{kind}/{name}")
        if live is not None and ownership.controlled_by(live.body["metadata"], uid):
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


async def _apply(child: dict[str, Any]) -> None:
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


@dataclass
class Applied:
    """What one pass applied: the pin it rendered, and whether it applied all of the spec."""

    pinned: dict[str, Any]
    digest: str
    reconciled: bool


async def _apply_children(
    body: kopf.Body,
    pool: PoolSpec,
    memo: kopf.Memo,
    observed: Observed,
    *,
    fresh: bool,
    replicas: int,
    rescaled: bool,
) -> Applied:
    """Apply every child when the spec or template changed, else those that drifted; the
    Deployment (and the engine-key Secret before it) when the autoscaler ``rescaled`` it to
    ``replicas`` or the fleet key changed. Never over an object the pool does not control."""
    metadata, spec, status = body["metadata"], body["spec"], body.get("status") or {}
    name, namespace = metadata["name"], metadata["namespace"]
    generation = metadata.get("generation", 0)
    chat_template = await read_chat_template(pool, namespace, memo, fresh)
    pinned = pinning.pinned_from_spec(spec, chat_template)
    digest = pinning.pinned_digest(pinned)
    engine_key = _engine_key(memo, namespace, name)
    image = _policy(memo).engine_image
    rendered = [
        render.render_configmap(name, pinned, chat_template),
        *([render.render_engine_key_secret(name, engine_key)] if engine_key else []),
        render.render_service(name),
        render.render_disruption_budget(name, pool),
        render.render_demand(name),
        # Last: its pods read the Secret and the ConfigMap above.
        render.render_deployment(name, pool, digest, image, replicas, engine_key),
    ]
    kopf.adopt(rendered, owner=body)
    reconcile = generation > status.get("observedGeneration", 0) or digest != status.get(
        "pinnedDigest"
    )
    rejected = memo.get("rejected")
    if rejected is not None and rejected[:2] == (generation, digest):
        raise ChildRejected(rejected[2])  # the same spec again: the same answer
    deployment = rendered[-1]
    # Like a restore, judged only once the indexes show the operator's own last apply.
    rekeyed = _restore_due(memo) and children.engine_key_changed(
        observed.children.get(f"Deployment/{deployment['metadata']['name']}"), deployment
    )
    due: list[tuple[dict[str, Any], str]] = []
    if reconcile:
        due = [(child, "") for child in rendered]
    elif rescaled or rekeyed:
        # The Deployment, and the Secret its new pods read: the autoscaler's Event, or the one
        # below, says why.
        due = [(child, "") for child in rendered if child["kind"] in ("Secret", "Deployment")]
    elif _restore_due(memo):
        for child in rendered:
            key = f"{child['kind']}/{child['metadata']['name']}"
            why = children.drift_message(
                child["kind"], child["metadata"]["name"], observed.children.get(key), child
            )
            if why:
                due.append((child, why))
    conflicts = await _conflicts(metadata["uid"], namespace, due, observed)
    if conflicts:
        raise ChildConflict(ownership.conflict_message(conflicts))
    try:
        for child, why in due:
            await _apply(child)
            if why:
                kopf.warn(body, reason=f"{child['kind']}Restored", message=why)
        if rekeyed and any(child is deployment for child, _ in due):
            message = "the fleet key changed: rolling the engines onto the pool's new key"
            kopf.event(body, type="Normal", reason="EngineKeyRotated", message=message)
    except ChildRejected as error:
        memo["rejected"] = (generation, digest, str(error))
        raise
    finally:
        if due:
            memo["applied_at"] = time.monotonic()
    memo.pop("rejected", None)
    return Applied(pinned=pinned, digest=digest, reconciled=reconcile)


def _reconciled_events(body: kopf.Body, status: Mapping[str, Any], applied: Applied) -> None:
    previous_digest = status.get("pinnedDigest")
    if previous_digest is None:
        message = f"engine pods pinned to {applied.digest}"
        kopf.event(body, type="Normal", reason="Reconciled", message=message)
    elif previous_digest != applied.digest:
        changed = _changed_pinned_fields(status.get("pinned") or {}, applied.pinned) or ["digest"]
        message = f"pinned {', '.join(changed)} changed: rolling to {applied.digest}"
        kopf.event(body, type="Normal", reason="RolloutStarted", message=message)


@dataclass(frozen=True)
class DriftCheck:
    """What one fingerprint check found: the drift entries (pinned fields, observed digests and
    adapters), how many replicas answered, and ``status.adapters``."""

    entries: list[drift.DriftEntry]
    checked: int
    adapters: list[dict[str, Any]]


async def _check_drift(
    body: kopf.Body,
    pool: PoolSpec,
    pods: list[PodView],
    pinned: Mapping[str, Any],
    digest: str,
    memo: kopf.Memo,
) -> DriftCheck:
    """Fingerprint the ready pods, bring their adapters in line with the spec, and judge them."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    report = await fingerprints.fetch_fingerprints(pods)
    for pod, why in report.unreachable.items():
        # Logged, not an Event: a pod on its way down would raise one every interval.
        metrics.FINGERPRINT_ERRORS.labels(namespace, name).inc()
        logger.warning("%s/%s: GET /fingerprint of pod %s failed: %s", namespace, name, pod, why)
    found = report.fingerprints
    entries = drift.classify_drift(found, pinned, digest)
    if pool.lora_settings is not None:
        key = _engine_key(memo, namespace, name)
        found, adapter_entries = await _converge_adapters(
            body, pool, pods, found, digest, key, memo
        )
        entries = sorted([*entries, *adapter_entries], key=lambda e: (e.pod, e.field))
    already_reported = {entry.get("pod") for entry in (body.get("status") or {}).get("drift") or []}
    for entry in entries:
        if entry.pod not in already_reported:
            message = f"pod {entry.pod}: {entry.field} is {entry.actual}, expected {entry.expected}"
            kopf.warn(body, reason="DriftDetected", message=message)
    return DriftCheck(entries, len(found), adapters.adapter_status(pool.adapters, found))


def _adapter_retry_due(memo: kopf.Memo, pool: PoolSpec) -> bool:
    """Whether loads that replicas refused are tried again this pass: once per drift interval
    (a replaced file, a fixed volume), never on every pass."""
    due = time.monotonic() - memo.get("adapter_retry_at", float("-inf")) >= (
        pool.drift_interval_seconds
    )
    if due:
        memo["adapter_retry_at"] = time.monotonic()
    return due


async def _converge_adapters(
    body: kopf.Body,
    pool: PoolSpec,
    pods: list[PodView],
    found: list[drift.Fingerprint],
    digest: str,
    engine_key: str | None,
    memo: kopf.Memo,
) -> tuple[list[drift.Fingerprint], list[drift.DriftEntry]]:
    """POST the planned loads, reloads and unloads (unloads first, to free slots; each group
    concurrently), fingerprint the pods acted on again, and judge the adapters from that.

    When every action succeeded the next pass checks again at once, so that reloads held back
    by ``rollout.maxUnavailable`` follow without waiting for the drift interval."""
    current = adapters.replicas(found, pods, digest)
    actions = adapters.plan_actions(
        pool.adapters,
        current,
        max_reloading_pods=pool.max_unavailable,
        retry_failed=_adapter_retry_due(memo, pool),
    )
    if actions:
        by_name = {p.name: p for p in pods}

        async def post(action: adapters.Action) -> adapters.Outcome:
            try:
                response = await fingerprints.post_to_pod(
                    by_name[action.pod], action.path, action.body, engine_key
                )
            except (httpx.HTTPError, ValueError) as error:
                return adapters.Outcome(action, None, f"{type(error).__name__}: {error}")
            return adapters.Outcome.of(action, response.status_code, response.text)

        outcomes = []
        for group in adapters.in_order(actions):
            outcomes += await asyncio.gather(*(post(action) for action in group))
        acted = sorted({a.pod for a in actions})
        again = await fingerprints.fetch_fingerprints([by_name[pod] for pod in acted])
        fresh = {f.pod: f for f in again.fingerprints}
        found = [fresh.get(f.pod, f) for f in found]
        after = adapters.replicas(found, pods, digest)
        for event in adapters.action_events(outcomes, before=current, after=after):
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        if all(outcome.ok for outcome in outcomes):
            memo.pop("last_drift_check", None)
        current = after
    return found, adapters.classify_adapter_drift(pool.adapters, current)


async def _autoscale(
    body: kopf.Body,
    pool: PoolSpec,
    pods: list[PodView],
    loads: Mapping[str, float],
    observed: Observed,
    reconciled: bool,
) -> autoscaling.Decision:
    """This pass's decision from the pool's load and the state kept in its status."""
    assert pool.autoscaling is not None
    status = body.get("status") or {}
    kept = status.get("autoscaling")
    try:
        state = autoscaling.ScalerState.from_status(kept) if kept else None
    except (KeyError, TypeError, ValueError) as error:
        logger.warning(
            "%s: unreadable status.autoscaling, starting over: %r", body.meta.name, error
        )
        state = None
    if state is None:
        current = observed.deployment.replicas if observed.deployment else None
        state = autoscaling.ScalerState.initial(pool.autoscaling, current)
    now = int(time.time())
    load = pool_demand(loads, observed.demand, now)
    digest = status.get("pinnedDigest")
    rolling = digest is not None and (
        pool_status.rollout_state(
            observed.deployment, pods, digest=digest, replicas=state.desired, reconciled=reconciled
        ).in_progress
    )
    return autoscaling.decide(
        pool.autoscaling, state, now=now, load=load, hold_down=rolling or bool(status.get("drift"))
    )


async def _write_deletion_costs(
    namespace: str, pods: list[PodView], loads: Mapping[str, float]
) -> None:
    for pod, cost in deletion_costs(pods, loads).items():
        try:
            await kube.annotate_pod(namespace, pod, {DELETION_COST_ANNOTATION: cost})
        except ApiException as error:
            logger.warning(
                "%s: setting the deletion cost of pod %s failed: %s", namespace, pod, error
            )


def _scaled_events(body: kopf.Body, decision: autoscaling.Decision) -> None:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    metrics.SCALINGS.labels(namespace, name, decision.reason).inc()
    kopf.event(body, type="Normal", reason=decision.reason, message=decision.message)


async def converge(
    *, namespace: str, name: str, uid: str, memo: kopf.Memo, observed: Observed
) -> None:
    """The one reconcile path: under the pool's lock, from the live pool."""
    async with _pool_lock(memo):
        live = await kube.read_pool(namespace, name)
        if live is None or live["metadata"].get("uid") != uid:
            return  # deleted (or deleted and created again: that one has its own handlers)
        if live["metadata"].get("deletionTimestamp"):
            return  # children go with the pool (owner references)
        await _converge(kopf.Body(cast(kopf.RawBody, live)), memo, observed)


async def _converge(body: kopf.Body, memo: kopf.Memo, observed: Observed) -> None:
    metadata, spec, status = body["metadata"], body["spec"], body.get("status") or {}
    name, namespace = metadata["name"], metadata["namespace"]
    generation = metadata.get("generation", 0)
    pool = PoolSpec.from_dict(spec)
    policy = _policy(memo)
    pods = owned_pods(observed.pods, naming.deployment_name(name))
    sizing = size_pool(pool)
    problems = list(sizing.problems)
    new_status: dict[str, Any] = {}
    reconciled = status.get("observedGeneration", 0) >= generation
    digest = status.get("pinnedDigest")
    pinned: Mapping[str, Any] = status.get("pinned") or {}
    attempts = int(status.get("driftRecreations") or 0)
    check_due = reconciled and digest is not None and _drift_check_due(memo, pool, pods)

    blocked = admission.refusal(pool, policy)
    scaling: autoscaling.Decision | None = None
    replicas = pool.replicas
    loads = await replica_loads(pods)
    # Before any scale-down this pass applies: the ReplicaSet then removes the idlest replica.
    await _write_deletion_costs(namespace, pods, loads)
    if blocked is None and pool.autoscaling is not None:
        scaling = await _autoscale(body, pool, pods, loads, observed, reconciled)
        replicas = scaling.state.desired
    elif pool.autoscaling is not None and status.get("autoscaling"):
        replicas = int(status["autoscaling"].get("desiredReplicas", pool.replicas))
    if blocked is None:
        try:
            applied = await _apply_children(
                body,
                pool,
                memo,
                observed,
                fresh=check_due or not reconciled,
                replicas=replicas,
                rescaled=scaling is not None and scaling.changed,
            )
        except ChatTemplateMissing as error:
            problems.append(str(error))
        except ChildRejected as error:
            blocked = admission.Refusal(APPLY_REJECTED, str(error))
        except ChildConflict as error:
            blocked = admission.Refusal(OWNERSHIP_CONFLICT, str(error))
        else:
            if applied.reconciled:
                _reconciled_events(body, status, applied)
                for problem in sizing.problems:
                    kopf.warn(body, reason="ImpossibleSpec", message=problem)
                if applied.digest != digest:
                    attempts = 0  # a new pin deserves its own recreations
                new_status.update(
                    pool_status.reconciled_status(
                        pool=name,
                        namespace=namespace,
                        generation=generation,
                        pinned=applied.pinned,
                        digest=applied.digest,
                        capacity=sizing.capacity,
                    )
                )
                reconciled = True
            digest, pinned = applied.digest, applied.pinned
            if scaling is not None and scaling.changed:
                _scaled_events(body, scaling)

    entries: list[drift.DriftEntry] | None = None
    checked = 0
    status_adapters: list[dict[str, Any]] | None = None
    if check_due and blocked is None and digest is not None:
        check = await _check_drift(body, pool, pods, pinned, digest, memo)
        entries, checked, status_adapters = check.entries, check.checked, check.adapters

    victims: list[str] = []
    gave_up: str | None = None
    if pool.drift_policy == "Recreate" and digest is not None:
        if entries is not None:
            rollout = pool_status.rollout_state(
                observed.deployment,
                pods,
                digest=digest,
                replicas=replicas,
                reconciled=reconciled,
            )
            candidates = drift.pods_to_recreate(
                entries,
                pods,
                digest=digest,
                replicas=replicas,
                max_unavailable=pool.max_unavailable,
                rollout_in_progress=rollout.in_progress,
            )
            remediation = drift.remediate(
                entries,
                candidates,
                checked=checked,
                replicas=replicas,
                attempts=attempts,
                max_attempts=policy.max_drift_recreations,
            )
            victims, attempts, gave_up = (
                remediation.victims,
                remediation.attempts,
                remediation.gave_up,
            )
        elif attempts >= policy.max_drift_recreations and status.get("drift"):
            gave_up = drift.persists_message(drift.entries_from_status(status["drift"]), attempts)
    elif entries == [] and checked >= replicas:
        attempts = 0

    observation = pool_status.Observation(
        pool=name,
        served_name=pool.served_name,
        served_name_rivals=served_names.rivals(
            observed.served_name_claims.get(pool.served_name, []), namespace
        ),
        revision=pool.revision,
        generation=generation,
        reconciled_generation=generation if reconciled else status.get("observedGeneration", 0),
        replicas=replicas,
        digest=digest or "",
        deployment=observed.deployment,
        pods=pods,
        problems=problems,
        drift=entries,
        checked_replicas=checked,
        adapters=status_adapters,
        blocked=blocked,
        drift_persists=gave_up,
    )
    new_status.update(pool_status.compute_status(observation, status, now=_now()))
    new_status["driftRecreations"] = attempts
    if scaling is not None:
        new_status["autoscaling"] = scaling.status()
    elif pool.autoscaling is None and "autoscaling" in status:
        new_status["autoscaling"] = None  # autoscaling was turned off: its state goes
    patch = pool_status.status_patch(status, new_status)
    if patch:
        await kube.patch_pool_status(namespace, name, patch)
    events = conditions.transition_events(status.get("conditions") or [], new_status["conditions"])
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    # A refusal that replaces another Degraded reason flips no status: say it anyway.
    previous_degraded = conditions.find(status.get("conditions") or [], conditions.DEGRADED) or {}
    if (
        blocked
        and previous_degraded.get("reason") != blocked.reason
        and not any(event.reason == blocked.reason for event in events)
    ):
        kopf.warn(body, reason=blocked.reason, message=blocked.message)

    metrics.READY_REPLICAS.labels(namespace, name).set(new_status["readyReplicas"])
    metrics.DESIRED_REPLICAS.labels(namespace, name).set(replicas)
    if scaling is not None:
        metrics.POOL_LOAD.labels(namespace, name).set(scaling.load)
    if entries is not None:
        metrics.DRIFTED_REPLICAS.labels(namespace, name).set(len(drift.drifted_pods(entries)))
    uids = {p.name: p.uid for p in pods}
    for pod in victims:
        if await kube.delete_pod(namespace, pod, uids[pod]):
            metrics.RECREATED_PODS.labels(namespace, name).inc()
            kopf.warn(body, reason="RecreatingDriftedPod", message=f"deleted drifted pod {pod}")
    await _prune_demand(namespace, name, stale_replicas(observed.demand, time.time()))


async def _prune_demand(namespace: str, name: str, replicas: list[str]) -> None:
    """Remove the records of gateway replicas long gone (their pods' names never come back)."""
    if not replicas:
        return
    patch = {DEMAND_GATEWAYS_FIELD: dict.fromkeys(replicas)}
    try:
        await kube.patch_demand_status(namespace, naming.demand_name(name), patch)
    except ApiException as error:
        logger.warning("%s/%s: pruning demand records failed: %s", namespace, name, error)


@kopf.on.resume(naming.GROUP, naming.VERSION, naming.PLURAL)
@kopf.on.create(naming.GROUP, naming.VERSION, naming.PLURAL)
@kopf.on.update(naming.GROUP, naming.VERSION, naming.PLURAL)
async def reconcile(
    body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, diff: kopf.Diff, **kwargs: Any
) -> None:
    namespace, name = meta["namespace"], meta["name"]
    _register(memo, namespace, name, meta["uid"])
    observed = observed_from_indexes((namespace, name), **kwargs)
    await converge(namespace=namespace, name=name, uid=meta["uid"], memo=memo, observed=observed)
    change = replica_change(diff)
    if change is not None:
        message = f"replicas {change[0]} -> {change[1]} (pods keep their template)"
        kopf.event(body, type="Normal", reason="Scaled", message=message)


@kopf.on.delete(naming.GROUP, naming.VERSION, naming.PLURAL, optional=True)
def forget(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Children go with the pool (owner references); only the metric series stay behind."""
    metrics.forget_pool(namespace or "", name)
    _pool_handles(memo).pop((namespace or "", name), None)


def _pool_handles(memo: kopf.Memo) -> dict[tuple[str, str], PoolHandle]:
    """Every pool's handle, shared by all objects' memos (``main`` puts it in the operator's
    memo, which kopf copies shallowly into each object's); a private one in unit tests."""
    handles = memo.get("pool_handles")
    if handles is None:
        handles = memo["pool_handles"] = {}
    return cast(dict[tuple[str, str], PoolHandle], handles)


def _register(memo: kopf.Memo, namespace: str, name: str, uid: str) -> None:
    _pool_handles(memo)[(namespace, name)] = PoolHandle(uid=uid, memo=memo)


@kopf.on.event(naming.GROUP, naming.VERSION, naming.DEMAND_PLURAL, labels=CHILD_WATCH_LABELS)  # type: ignore[arg-type]
async def demand_changed(
    namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **kwargs: Any
) -> None:
    """A gateway recorded held requests: converge the pool now, not at its next timer run (a
    pool at zero replicas starts scaling up at once)."""
    if namespace is None:
        return
    name = labels[naming.POOL_LABEL]
    handle = _pool_handles(memo).get((namespace, name))
    if handle is None:
        return  # the pool's own handlers have not run yet; they will converge it
    observed = observed_from_indexes((namespace, name), **kwargs)
    await converge(
        namespace=namespace, name=name, uid=handle.uid, memo=handle.memo, observed=observed
    )


# kopf passes indexes as keyword arguments named after them, beyond its typed protocol.
@kopf.timer(naming.GROUP, naming.VERSION, naming.PLURAL, interval=STATUS_INTERVAL_SECONDS)  # type: ignore[arg-type]
async def observe(meta: kopf.Meta, memo: kopf.Memo, **kwargs: Any) -> None:
    namespace, name = meta["namespace"], meta["name"]
    _register(memo, namespace, name, meta["uid"])
    observed = observed_from_indexes((namespace, name), **kwargs)
    await converge(namespace=namespace, name=name, uid=meta["uid"], memo=memo, observed=observed)
