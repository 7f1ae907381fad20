"""A pool's observed status (counts, rollout, conditions) from its Deployment and Pods."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmpool.operator import conditions as cond
from llmpool.operator import naming
from llmpool.operator.admission import Refusal
from llmpool.operator.drift import DriftEntry, drifted_pods
from llmpool.operator.served_names import served_name_condition
from llmpool.operator.views import DeploymentView, PodView, Termination

# The engine writes "RevisionMismatch: ..." to its termination log and exits with code 3 when
# the model files it loads do not match spec.model.revision.
REVISION_MISMATCH_EXIT_CODE = 3
REVISION_MISMATCH_PREFIX = "RevisionMismatch"
MAX_MESSAGE_ITEMS = 5
DRIFT_PERSISTS = "DriftPersists"


@dataclass(frozen=True)
class Rollout:
    in_progress: bool  # some pod, or the Deployment itself, is not on the current digest yet
    complete: bool  # every desired replica is ready and serves the current digest
    reason: str
    message: str


def rollout_state(
    deployment: DeploymentView | None,
    pods: Sequence[PodView],
    *,
    digest: str,
    replicas: int,
    reconciled: bool,
) -> Rollout:
    """Where the pool stands between its spec and its pods.

    Complete only when the Deployment controller has observed the current template and
    ``updatedReplicas == readyReplicas == replicas`` with every live pod on ``digest``.
    """
    if not reconciled or deployment is None:
        return Rollout(True, False, "Reconciling", "the operator has not applied the spec yet")
    live = [p for p in pods if not p.terminating]
    stale = [p.name for p in live if p.digest != digest]
    ready_current = sum(1 for p in live if p.ready and p.digest == digest)
    observed = deployment.observed_generation >= deployment.generation
    if deployment.digest != digest or not observed or stale:
        message = f"{deployment.updated_replicas}/{replicas} replicas on {digest[:19]}"
        if stale:
            message += f"; still on an older digest: {_names(stale)}"
        return Rollout(True, False, "RollingOut", message)
    counts_match = (
        deployment.replicas == replicas
        and deployment.updated_replicas == replicas
        and deployment.ready_replicas == replicas
        and deployment.status_replicas == replicas
        and ready_current == replicas
        and len(live) == replicas
    )
    if not counts_match:
        message = f"{ready_current}/{replicas} replicas ready"
        return Rollout(False, False, "ReplicasNotReady", message)
    return Rollout(False, True, "RolloutComplete", f"{replicas}/{replicas} replicas ready")


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MAX_MESSAGE_ITEMS])
    more = len(names) - MAX_MESSAGE_ITEMS
    return shown + (f" and {more} more" if more > 0 else "")


def _is_revision_mismatch(termination: Termination | None) -> bool:
    if termination is None:
        return False
    message = (termination.message or "").lstrip()
    return termination.exit_code == REVISION_MISMATCH_EXIT_CODE or message.startswith(
        REVISION_MISMATCH_PREFIX
    )


def _first_line(termination: Termination | None) -> str:
    if termination is None or not termination.message:
        return ""
    return termination.message.strip().splitlines()[0]


def degraded_condition(
    pods: Sequence[PodView],
    deployment: DeploymentView | None,
    problems: Sequence[str],
    revision: str,
    drift_persists: str | None = None,
) -> cond.Condition:
    """Degraded, with the most specific reason first: a revision mismatch explains a crash loop."""
    mismatched = [
        p
        for p in pods
        if _is_revision_mismatch(p.terminated) or _is_revision_mismatch(p.last_terminated)
    ]
    if mismatched:
        pod = mismatched[0]
        termination = pod.terminated or pod.last_terminated
        detail = _first_line(pod.terminated) or _first_line(pod.last_terminated)
        if not detail and termination is not None:
            detail = f"exit code {termination.exit_code}"
        message = f"the model files do not match spec.model.revision {revision} (pod {pod.name}: {detail})"
        return cond.Condition(cond.DEGRADED, "True", "RevisionMismatch", message)
    crashing = [p for p in pods if p.waiting_reason == "CrashLoopBackOff"]
    if crashing:
        pod = crashing[0]
        detail = _first_line(pod.last_terminated) or "see the pod's logs"
        message = f"{_names([p.name for p in crashing])} crash-looping ({detail})"
        return cond.Condition(cond.DEGRADED, "True", "CrashLoopBackOff", message)
    if problems:
        return cond.Condition(cond.DEGRADED, "True", "InvalidConfiguration", "; ".join(problems))
    if drift_persists:
        return cond.Condition(cond.DEGRADED, "True", DRIFT_PERSISTS, drift_persists)
    if deployment is not None and deployment.progress_deadline_exceeded:
        message = "the engine Deployment exceeded its progress deadline"
        return cond.Condition(cond.DEGRADED, "True", "ProgressDeadlineExceeded", message)
    return cond.Condition(cond.DEGRADED, "False", "AsExpected", "no replica is failing")


def drifted_condition(entries: Sequence[DriftEntry], checked: int) -> cond.Condition:
    pods = drifted_pods(entries)
    if not pods and checked == 0:
        message = "no ready replica to check"
        return cond.Condition(cond.DRIFTED, "Unknown", "NotChecked", message)
    if not pods:
        message = f"{checked} checked replica(s) run the pin"
        return cond.Condition(cond.DRIFTED, "False", "NoDrift", message)
    fields = sorted({e.field for e in entries})
    message = f"{len(pods)} replica(s) drifted ({_names(pods)}): {', '.join(fields)}"
    return cond.Condition(cond.DRIFTED, "True", "ReplicasDrifted", message)


def ready_condition(rollout: Rollout, replicas: int) -> cond.Condition:
    if rollout.complete and replicas > 0:
        return cond.Condition(cond.READY, "True", "AllReplicasReady", rollout.message)
    if replicas == 0:
        return cond.Condition(cond.READY, "False", "ScaledToZero", "0 replicas desired")
    return cond.Condition(cond.READY, "False", rollout.reason, rollout.message)


def progressing_condition(rollout: Rollout) -> cond.Condition:
    status: cond.Status = "False" if rollout.complete else "True"
    return cond.Condition(cond.PROGRESSING, status, rollout.reason, rollout.message)


@dataclass(frozen=True)
class Observation:
    """Everything the status is computed from, gathered by the handler."""

    pool: str
    revision: str
    generation: int
    reconciled_generation: int
    replicas: int
    digest: str
    deployment: DeploymentView | None
    pods: Sequence[PodView]  # the pods of the pool's Deployment (``owned_pods``)
    problems: Sequence[str] = ()
    # None: no fingerprint check this time; keep the previous drift report.
    drift: Sequence[DriftEntry] | None = None
    checked_replicas: int = 0
    # Why the operator does not apply the spec at all (a refused image or host path, or the
    # API server rejecting a child): the pool is then neither Ready nor Progressing.
    blocked: Refusal | None = None
    # Set when policy Recreate gave up: what still differs after the allowed recreations.
    drift_persists: str | None = None
    served_name: str = ""
    # ``namespace/name`` of the pools of other namespaces that claim the same served name.
    served_name_rivals: Sequence[str] = ()
    # status.adapters from this pass's fingerprint check (adapters.adapter_status); None: not
    # checked (or LoRA off), keep the previous list.
    adapters: Sequence[Mapping[str, Any]] | None = None


def compute_status(
    observation: Observation, previous: Mapping[str, Any], *, now: str, rollout: Rollout
) -> dict[str, Any]:
    """The status fields the observation decides (a subset of status; merge into it), with
    ``rollout``: the ``rollout_state`` of the same observation."""
    pods = observation.pods
    desired = [
        ready_condition(rollout, observation.replicas),
        progressing_condition(rollout),
        degraded_condition(
            pods,
            observation.deployment,
            observation.problems,
            observation.revision,
            observation.drift_persists,
        ),
    ]
    if observation.blocked is not None:
        reason, message = observation.blocked.reason, observation.blocked.message
        desired = [
            cond.Condition(cond.READY, "False", reason, message),
            cond.Condition(cond.PROGRESSING, "False", reason, message),
            cond.Condition(cond.DEGRADED, "True", reason, message),
        ]
    if observation.drift is not None:
        desired.append(drifted_condition(observation.drift, observation.checked_replicas))
    elif cond.find(previous.get("conditions") or [], cond.DRIFTED) is None:
        message = "no replica has been checked yet"
        desired.append(cond.Condition(cond.DRIFTED, "Unknown", "NotChecked", message))
    desired.append(served_name_condition(observation.served_name, observation.served_name_rivals))

    deployment = observation.deployment
    ready = deployment.ready_replicas if deployment else 0
    status: dict[str, Any] = {
        "replicas": deployment.status_replicas if deployment else 0,
        "readyReplicas": ready,
        "updatedReplicas": deployment.updated_replicas if deployment else 0,
        "replicaSummary": f"{ready}/{observation.replicas}",
        "selector": naming.selector_string(observation.pool),
        "conditions": cond.merge_conditions(
            previous.get("conditions") or [],
            desired,
            generation=observation.generation,
            now=now,
        ),
    }
    status["outgoing"] = outgoing_replicas(pods, observation.digest)
    if observation.drift is not None:
        status["drift"] = [entry.as_status() for entry in observation.drift]
    if observation.adapters is not None and (observation.adapters or previous.get("adapters")):
        status["adapters"] = [dict(adapter) for adapter in observation.adapters]
    return status


def outgoing_replicas(pods: Sequence[PodView], digest: str) -> list[dict[str, str]]:
    """The pods of older templates, each with the digest its own template pins.

    Written in the same status patch as a new ``pinnedDigest``, so that a reader (the gateway)
    never sees the new pin without knowing which replicas are still held to an older one: they
    keep serving until the rollout replaces them.
    """
    return [
        {"pod": p.name, "pinnedDigest": p.digest}
        for p in sorted(pods, key=lambda p: p.name)
        if p.digest is not None and p.digest != digest
    ]


def status_patch(previous: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch that turns the ``new`` fields of ``previous`` into ``new``.

    Top-level fields not in ``new`` are left alone (other writers own them); inside a field,
    keys that ``new`` lacks are deleted (merge patches merge nested objects). Empty when
    nothing changed, so that a quiet pool is never patched.
    """
    return _object_patch(previous, new, delete_missing=False)


def _object_patch(
    old: Mapping[str, Any], new: Mapping[str, Any], *, delete_missing: bool
) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if before == value:
            continue
        if isinstance(before, Mapping) and isinstance(value, Mapping):
            patch[key] = _object_patch(before, value, delete_missing=True)
        else:
            patch[key] = value
    if delete_missing:
        patch.update({gone: None for gone in old.keys() - new.keys()})
    return patch


def short_revision(revision: str) -> str:
    """The first 12 hex characters of a revision, without its ``sha256:`` prefix."""
    return revision.removeprefix("sha256:")[:12]


def reconciled_status(
    *,
    pool: str,
    namespace: str,
    generation: int,
    pinned: Mapping[str, Any],
    digest: str,
    capacity: Mapping[str, Any],
) -> dict[str, Any]:
    """The status fields a reconcile decides: what the children were rendered from."""
    return {
        "observedGeneration": generation,
        "pinnedDigest": digest,
        "pinned": dict(pinned),
        "shortRevision": short_revision(pinned["revision"]),
        "endpoint": naming.endpoint(pool, namespace),
        "capacity": dict(capacity),
        "selector": naming.selector_string(pool),
    }
