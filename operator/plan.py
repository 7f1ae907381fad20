"""One reconcile pass's decisions from what the pass observed. Pure: no API server, no HTTP, no
clock (the observation carries the time), no kopf machinery (only ``kopf.adopt``, which fills in
owner references, namespace and labels on plain dicts).

A pass is observe (``observe``) -> plan (here) -> act (``act``). ``plan`` decides, in this order:
the autoscaler's replica count, which children to apply (every child when the spec or the
user's chat template changed; the Deployment and the engine-key Secret when the autoscaler
rescaled or the fleet key changed; otherwise each child the indexes show missing or edited), the
drift policy's verdict on the fingerprint check the observation carries, the status patch and
the Events, and the metrics. It also returns the pool's next ``PoolState``.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import kopf

from llmpool import pinning
from llmpool.load import Demand, stale_replicas
from llmpool.operator import admission, autoscaling, children, conditions, drift, render
from llmpool.operator import status as pool_status
from llmpool.operator.conditions import Event
from llmpool.operator.pool_load import deletion_costs, pool_demand
from llmpool.operator.pool_state import CheckSignature, PoolState, Rejection
from llmpool.operator.served_names import rivals
from llmpool.operator.sizing import Sizing, size_pool
from llmpool.operator.spec import PoolSpec
from llmpool.operator.views import DeploymentView, PodView

# The indexes lag a fresh apply by a moment: a child is not "missing" or "different" until the
# operator's own last apply is this old.
RESTORE_GRACE_SECONDS = 5
APPLY_REJECTED = "ApplyRejected"
OWNERSHIP_CONFLICT = "OwnershipConflict"


@dataclass(frozen=True)
class PoolObject:
    """The live LLMPool a pass reads under the pool's lock, its spec parsed once."""

    body: Mapping[str, Any]  # the owner ``kopf.adopt`` writes into every child
    namespace: str
    name: str
    uid: str
    generation: int
    spec: PoolSpec
    status: Mapping[str, Any]
    sizing: Sizing  # the spec's capacity and the problems that make it impossible

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PoolObject:
        metadata = body["metadata"]
        spec = PoolSpec.from_dict(body["spec"])
        return cls(
            body=body,
            namespace=metadata["namespace"],
            name=metadata["name"],
            uid=metadata["uid"],
            generation=metadata.get("generation", 0),
            spec=spec,
            status=body.get("status") or {},
            sizing=size_pool(spec),
        )

    @property
    def applied_generation(self) -> int:
        return int(self.status.get("observedGeneration", 0))

    @property
    def reconciled(self) -> bool:
        """Whether the children were rendered from this generation (before this pass)."""
        return self.applied_generation >= self.generation

    @property
    def digest(self) -> str | None:
        """The pin applied before this pass; None until the first apply."""
        return self.status.get("pinnedDigest")


@dataclass(frozen=True)
class DriftCheck:
    """What one fingerprint check found: the drift entries (pinned fields, observed digests and
    adapters), how many replicas answered, ``status.adapters``, and what the adapter actions it
    took (``adapters.plan_actions``) reported."""

    entries: list[drift.DriftEntry]
    checked: int
    adapters: list[dict[str, Any]]
    adapter_events: list[Event] = field(default_factory=list)
    retried: bool = False  # loads the replicas refused before were tried again
    recheck: bool = False  # every adapter action succeeded: check again next pass


@dataclass(frozen=True)
class Observed:
    """Everything one pass looked at: the indexes' view of the pool, the time, the replicas'
    load, what the pool's children are rendered from, and the fingerprint check, if one was
    due."""

    pods: list[PodView]  # the pods of the pool's Deployment (``views.owned_pods``)
    deployment: DeploymentView | None
    wall: float  # time.time()
    monotonic: float  # time.monotonic(): what ``PoolState`` times are measured in
    children: Mapping[str, children.ChildView] = field(default_factory=dict)  # by kind/name
    demand: Mapping[str, Demand] = field(default_factory=dict)  # by gateway replica
    served_name_claims: Mapping[str, Iterable[tuple[str, str]]] = field(default_factory=dict)
    loads: Mapping[str, float] = field(default_factory=dict)  # requests in flight, by pod
    chat_template: str | None = None  # the user's template (None: the model's own)
    template_missing: str | None = None  # why the user's template could not be read
    engine_key: str | None = None  # the pool's key from the fleet key; None in open mode
    drift: DriftCheck | None = None
    conflict: str | None = None  # objects the pool does not control in the way of its children


@dataclass(frozen=True)
class ChildApply:
    body: dict[str, Any]
    restored: str = ""  # why a child the pool had is applied again (a ``*Restored`` warning)


@dataclass(frozen=True)
class MetricValues:
    ready_replicas: int
    desired_replicas: int
    load: float | None  # an autoscaled pool's load
    drifted_replicas: int | None  # None: no check this pass
    scaled: str | None  # the autoscaler's reason when it changed the count


@dataclass(frozen=True)
class Plan:
    """What a pass does, in the order ``act`` does it."""

    deletion_costs: dict[str, str]  # by pod: before any scale-down this pass applies
    children: list[ChildApply]  # in order: the Deployment last, its pods read the others
    applied_events: list[Event]  # once every child is applied
    events: list[Event]  # before the status patch
    status_patch: dict[str, Any]
    transition_events: list[Event]  # after it: conditions that flipped, a new refusal
    metrics: MetricValues
    pods_to_delete: list[tuple[str, str]]  # (name, uid) of drifted pods to recreate
    stale_demand: list[str]  # gateway replicas long gone whose demand records go
    scaling: autoscaling.Decision | None
    digest: str | None  # the pin rendered this pass (what a rejection is remembered by)
    state: PoolState


def rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_signature(spec: PoolSpec, pods: Sequence[PodView]) -> CheckSignature:
    """Changes when a pod comes, goes, restarts or turns (un)ready, or the adapters of the spec
    change (the check is where adapters are loaded and unloaded): a reason to check now."""
    pods_signature = tuple(sorted((p.uid, p.ready, p.restart_count) for p in pods))
    return pods_signature, spec.lora_settings, spec.adapters


def drift_check_due(
    pool: PoolObject, pods: Sequence[PodView], state: PoolState, monotonic: float
) -> bool:
    """Whether this pass fingerprints the replicas: once a pin is applied, every drift
    interval, and at once when ``check_signature`` changed."""
    if not pool.reconciled or pool.digest is None:
        return False
    return check_signature(pool.spec, pods) != state.check_signature or (
        monotonic - state.last_drift_check >= pool.spec.drift_interval_seconds
    )


def restore_due(state: PoolState, monotonic: float) -> bool:
    """Whether the last apply is old enough for the indexes to show what it wrote."""
    return monotonic - state.applied_at >= RESTORE_GRACE_SECONDS


def adapter_retry_due(state: PoolState, spec: PoolSpec, monotonic: float) -> bool:
    """Whether loads that replicas refused are tried again this pass: once per drift interval
    (a replaced file, a fixed volume), never on every pass."""
    return monotonic - state.adapter_retry_at >= spec.drift_interval_seconds


def rendered_pin(pool: PoolObject, observed: Observed) -> tuple[Mapping[str, Any], str | None]:
    """The pin this pass renders, or the one applied before when the template is missing."""
    if observed.template_missing is not None:
        return pool.status.get("pinned") or {}, pool.digest
    pinned = pool.spec.pin.pinned(observed.chat_template)
    return pinned, pinning.pinned_digest(pinned)


def rejected_again(pool: PoolObject, state: PoolState, digest: str | None) -> Rejection | None:
    """The API server's answer to this very spec, if it refused it before."""
    rejected = state.rejected
    if rejected is not None and (rejected.generation, rejected.digest) == (pool.generation, digest):
        return rejected
    return None


@dataclass(frozen=True)
class _Applying:
    """The children step: what it applies, and the pin the rest of the pass goes on with."""

    pinned: Mapping[str, Any]
    digest: str | None
    reconciled: bool  # the children are rendered from this generation (after this pass)
    blocked: admission.Refusal | None = None
    problems: list[str] = field(default_factory=list)
    children: list[ChildApply] = field(default_factory=list)
    applied_events: list[Event] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    new_pin: bool = False  # a new pin deserves its own drift recreations
    done: bool = False  # went through: an earlier rejection is forgotten


def plan(
    pool: PoolObject, observed: Observed, state: PoolState, *, policy: admission.Policy
) -> Plan:
    """The pass for ``pool`` as ``observed``, with its memory ``state``, under the operator's
    admission ``policy``. The same inputs give the same plan."""
    refusal = admission.refusal(pool.spec, policy)
    scaling = None
    if refusal is None and pool.spec.autoscaling is not None:
        scaling = _autoscale(pool, observed)
    replicas = _replicas(pool, scaling)
    applying = _apply_children(pool, observed, state, policy, refusal, replicas, scaling)
    check_due = drift_check_due(pool, observed.pods, state, observed.monotonic)
    check = observed.drift if check_due and applying.blocked is None else None
    rollout = pool_status.rollout_state(
        observed.deployment,
        observed.pods,
        digest=applying.digest or "",
        replicas=replicas,
        reconciled=applying.reconciled,
    )
    verdict = _drift_verdict(pool, observed, policy, applying, check, rollout, replicas)
    status = _status(pool, observed, applying, verdict, check, rollout, replicas)
    if scaling is not None:
        status["autoscaling"] = scaling.status()
    elif pool.spec.autoscaling is None and "autoscaling" in pool.status:
        status["autoscaling"] = None  # autoscaling was turned off: its state goes
    drifted = None if check is None else len(drift.drifted_pods(check.entries))
    scaled = scaling.reason if scaling is not None and scaling.changed and applying.done else None
    uids = {p.name: p.uid for p in observed.pods}
    return Plan(
        deletion_costs=deletion_costs(observed.pods, observed.loads),
        children=applying.children,
        applied_events=applying.applied_events,
        events=[*applying.events, *verdict.events],
        status_patch=pool_status.status_patch(pool.status, status),
        transition_events=_transition_events(pool, status, applying.blocked),
        metrics=MetricValues(
            ready_replicas=status["readyReplicas"],
            desired_replicas=replicas,
            load=None if scaling is None else scaling.load,
            drifted_replicas=drifted,
            scaled=scaled,
        ),
        pods_to_delete=[(pod, uids[pod]) for pod in verdict.victims],
        stale_demand=stale_replicas(observed.demand, observed.wall),
        scaling=scaling,
        digest=applying.digest,
        state=_next_state(pool, observed, state, applying, check_due),
    )


def _autoscale(pool: PoolObject, observed: Observed) -> autoscaling.Decision:
    """This pass's decision from the pool's load and the state kept in its status; scaling
    down waits while the rollout the pass started from, or a drift recreation, runs."""
    spec = pool.spec.autoscaling
    assert spec is not None
    current = observed.deployment.replicas if observed.deployment else None
    state = autoscaling.ScalerState.kept_or_initial(
        pool.status.get("autoscaling"), spec, current, pool=pool.name
    )
    now = int(observed.wall)
    rolling = pool.digest is not None and (
        pool_status.rollout_state(
            observed.deployment,
            observed.pods,
            digest=pool.digest,
            replicas=state.desired,
            reconciled=pool.reconciled,
        ).in_progress
    )
    load = pool_demand(observed.loads, observed.demand, now)
    hold_down = rolling or bool(pool.status.get("drift"))
    return autoscaling.decide(spec, state, now=now, load=load, hold_down=hold_down)


def _replicas(pool: PoolObject, scaling: autoscaling.Decision | None) -> int:
    if scaling is not None:
        return scaling.state.desired
    kept = pool.status.get("autoscaling")
    if pool.spec.autoscaling is not None and kept:
        return int(kept.get("desiredReplicas", pool.spec.replicas))
    return pool.spec.replicas


def _rendered_children(
    pool: PoolObject,
    pinned: dict[str, Any],
    digest: str,
    observed: Observed,
    policy: admission.Policy,
    replicas: int,
) -> list[dict[str, Any]]:
    name, key = pool.name, observed.engine_key
    patience = policy.engine_gemm_probe_patience_s
    deployment = render.render_deployment(
        name, pool.spec, digest, policy.engine_image, replicas, key, patience
    )
    rendered = [
        render.render_configmap(name, pinned, observed.chat_template),
        *([render.render_engine_key_secret(name, key)] if key else []),
        render.render_service(name),
        render.render_disruption_budget(name, pool.spec),
        render.render_demand(name),
        # Last: its pods read the Secret and the ConfigMap above.
        deployment,
    ]
    kopf.adopt(rendered, owner=cast(kopf.Body, pool.body))
    return rendered


def _apply_children(
    pool: PoolObject,
    observed: Observed,
    state: PoolState,
    policy: admission.Policy,
    refusal: admission.Refusal | None,
    replicas: int,
    scaling: autoscaling.Decision | None,
) -> _Applying:
    pinned, digest = rendered_pin(pool, observed)
    before = _Applying(pool.status.get("pinned") or {}, pool.digest, pool.reconciled, refusal)
    if refusal is not None:
        return before
    if observed.template_missing is not None or digest is None:
        return replace(before, problems=[str(observed.template_missing)])
    rejected = rejected_again(pool, state, digest)
    if rejected is not None:  # the same spec again: the same answer
        return replace(before, blocked=admission.Refusal(APPLY_REJECTED, rejected.message))
    if observed.conflict is not None:
        return replace(before, blocked=admission.Refusal(OWNERSHIP_CONFLICT, observed.conflict))
    rendered = _rendered_children(pool, dict(pinned), digest, observed, policy, replicas)
    reconcile = pool.generation > pool.applied_generation or digest != pool.digest
    rescaled = scaling is not None and scaling.changed
    due, rekeyed = _children_due(rendered, observed, state, reconcile=reconcile, rescaled=rescaled)
    applying = _Applying(pinned, digest, reconcile or pool.reconciled, children=due, done=True)
    if rekeyed and any(child.body is rendered[-1] for child in due):
        message = "the fleet key changed: rolling the engines onto the pool's new key"
        applying.applied_events.append(Event("Normal", "EngineKeyRotated", message))
    if reconcile:
        applying.events.extend(_reconciled_events(pool, pinned, digest))
        applying.status.update(
            pool_status.reconciled_status(
                pool=pool.name,
                namespace=pool.namespace,
                generation=pool.generation,
                pinned=pinned,
                digest=digest,
                capacity=pool.sizing.capacity,
            )
        )
    if scaling is not None and scaling.changed:
        applying.events.append(Event("Normal", scaling.reason, scaling.message))
    return replace(applying, new_pin=reconcile and digest != pool.digest)


def _children_due(
    rendered: list[dict[str, Any]],
    observed: Observed,
    state: PoolState,
    *,
    reconcile: bool,
    rescaled: bool,
) -> tuple[list[ChildApply], bool]:
    """The children to apply and whether the fleet key changed under the Deployment. Like a
    restore, a new key is judged only once the indexes show the operator's own last apply."""
    deployment = rendered[-1]
    restore = restore_due(state, observed.monotonic)
    rekeyed = restore and children.engine_key_changed(
        observed.children.get(f"Deployment/{deployment['metadata']['name']}"), deployment
    )
    if reconcile:
        return [ChildApply(child) for child in rendered], rekeyed
    if rescaled or rekeyed:
        # The Deployment, and the Secret its new pods read: the autoscaler's Event, or the
        # EngineKeyRotated one, says why.
        keyed = [child for child in rendered if child["kind"] in ("Secret", "Deployment")]
        return [ChildApply(child) for child in keyed], rekeyed
    if not restore:
        return [], rekeyed
    due = []
    for child in rendered:
        kind, name = child["kind"], child["metadata"]["name"]
        why = children.drift_message(kind, name, observed.children.get(f"{kind}/{name}"), child)
        if why:
            due.append(ChildApply(child, why))
    return due, rekeyed


def _reconciled_events(pool: PoolObject, pinned: Mapping[str, Any], digest: str) -> list[Event]:
    events = []
    if pool.digest is None:
        events.append(Event("Normal", "Reconciled", f"engine pods pinned to {digest}"))
    elif pool.digest != digest:
        before = pool.status.get("pinned") or {}
        changed = [key for key in pinning.PINNED_KEYS if before.get(key) != pinned.get(key)]
        message = f"pinned {', '.join(changed or ['digest'])} changed: rolling to {digest}"
        events.append(Event("Normal", "RolloutStarted", message))
    for problem in pool.sizing.problems:
        events.append(Event("Warning", "ImpossibleSpec", problem))
    return events


@dataclass(frozen=True)
class _Verdict:
    """The drift policy's answer to this pass's check."""

    attempts: int  # status.driftRecreations
    victims: list[str] = field(default_factory=list)
    gave_up: str | None = None  # the Degraded/DriftPersists message
    events: list[Event] = field(default_factory=list)


def _drift_verdict(
    pool: PoolObject,
    observed: Observed,
    policy: admission.Policy,
    applying: _Applying,
    check: DriftCheck | None,
    rollout: pool_status.Rollout,
    replicas: int,
) -> _Verdict:
    attempts = 0 if applying.new_pin else int(pool.status.get("driftRecreations") or 0)
    events = [] if check is None else _drift_events(pool, check)
    if pool.spec.drift_policy == "Recreate" and applying.digest is not None:
        if check is not None:
            candidates = drift.pods_to_recreate(
                check.entries,
                observed.pods,
                digest=applying.digest,
                replicas=replicas,
                max_unavailable=pool.spec.max_unavailable,
                rollout_in_progress=rollout.in_progress,
            )
            remediation = drift.remediate(
                check.entries,
                candidates,
                checked=check.checked,
                replicas=replicas,
                attempts=attempts,
                max_attempts=policy.max_drift_recreations,
            )
            return _Verdict(remediation.attempts, remediation.victims, remediation.gave_up, events)
        reported = pool.status.get("drift")
        if attempts >= policy.max_drift_recreations and reported:
            message = drift.persists_message(drift.entries_from_status(reported), attempts)
            return _Verdict(attempts, gave_up=message, events=events)
    elif check is not None and check.entries == [] and check.checked >= replicas:
        attempts = 0
    return _Verdict(attempts, events=events)


def _drift_events(pool: PoolObject, check: DriftCheck) -> list[Event]:
    """What the adapter actions did, then each drifted pod the last report did not name."""
    reported = {entry.get("pod") for entry in pool.status.get("drift") or []}
    return [*check.adapter_events] + [
        Event(
            "Warning",
            "DriftDetected",
            f"pod {entry.pod}: {entry.field} is {entry.actual}, expected {entry.expected}",
        )
        for entry in check.entries
        if entry.pod not in reported
    ]


def _status(
    pool: PoolObject,
    observed: Observed,
    applying: _Applying,
    verdict: _Verdict,
    check: DriftCheck | None,
    rollout: pool_status.Rollout,
    replicas: int,
) -> dict[str, Any]:
    observation = pool_status.Observation(
        pool=pool.name,
        served_name=pool.spec.served_name,
        served_name_rivals=rivals(
            observed.served_name_claims, pool.spec.served_name, pool.namespace
        ),
        revision=pool.spec.revision,
        generation=pool.generation,
        reconciled_generation=(pool.generation if applying.reconciled else pool.applied_generation),
        replicas=replicas,
        digest=applying.digest or "",
        deployment=observed.deployment,
        pods=observed.pods,
        problems=[*pool.sizing.problems, *applying.problems],
        drift=None if check is None else check.entries,
        checked_replicas=0 if check is None else check.checked,
        adapters=None if check is None else check.adapters,
        blocked=applying.blocked,
        drift_persists=verdict.gave_up,
    )
    computed = pool_status.compute_status(
        observation, pool.status, now=rfc3339(observed.wall), rollout=rollout
    )
    return {**applying.status, **computed, "driftRecreations": verdict.attempts}


def _transition_events(
    pool: PoolObject, status: Mapping[str, Any], blocked: admission.Refusal | None
) -> list[Event]:
    previous = pool.status.get("conditions") or []
    events = conditions.transition_events(previous, status["conditions"])
    # A refusal that replaces another Degraded reason flips no status: say it anyway.
    degraded = conditions.find(previous, conditions.DEGRADED) or {}
    if (
        blocked
        and degraded.get("reason") != blocked.reason
        and not any(event.reason == blocked.reason for event in events)
    ):
        events.append(Event("Warning", blocked.reason, blocked.message))
    return events


def _next_state(
    pool: PoolObject, observed: Observed, state: PoolState, applying: _Applying, check_due: bool
) -> PoolState:
    ref, now = pool.spec.chat_template, observed.monotonic
    if ref is not None and observed.chat_template is not None:
        state = replace(state, chat_template=(ref, observed.chat_template))
    if applying.done:
        state = replace(state, rejected=None)
    if check_due:
        recheck = observed.drift is not None and observed.drift.recheck
        state = replace(
            state,
            check_signature=check_signature(pool.spec, observed.pods),
            last_drift_check=float("-inf") if recheck else now,
        )
    if observed.drift is not None and observed.drift.retried:
        state = replace(state, adapter_retry_at=now)
    return state
