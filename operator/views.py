"""Compact, immutable views of engine Pods and Deployments: what the operator keeps in its indexes."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmpool.operator import naming

# Set by the Deployment controller on every pod of a ReplicaSet it created.
POD_TEMPLATE_HASH_LABEL = "pod-template-hash"
# Read by the ReplicaSet controller on scale-down: among ready pods, the lowest cost goes first.
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class Termination:
    exit_code: int | None
    reason: str | None
    message: str | None


@dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    digest: str | None
    ready: bool
    ip: str | None
    terminating: bool
    restart_count: int = 0
    waiting_reason: str | None = None
    terminated: Termination | None = None
    last_terminated: Termination | None = None
    # The ReplicaSet that controls the pod (ownerReferences), and the pod-template-hash label
    # its Deployment gave it: together they tell the pool's own pods from look-alikes.
    replica_set: str | None = None
    template_hash: str | None = None
    deletion_cost: str | None = None  # the pod-deletion-cost annotation as the operator last set it
    adapter_roots: tuple[str, ...] = ()  # the template's llmpool.dev/adapter-roots

    def belongs_to(self, deployment: str) -> bool:
        """Whether a ReplicaSet of Deployment ``deployment`` controls this pod."""
        if self.replica_set is None or self.template_hash is None:
            return False
        return self.replica_set == f"{deployment}-{self.template_hash}"


@dataclass(frozen=True)
class DeploymentView:
    generation: int
    observed_generation: int
    digest: str | None
    replicas: int
    status_replicas: int
    ready_replicas: int
    updated_replicas: int
    progress_deadline_exceeded: bool


def _termination(state: Mapping[str, Any] | None) -> Termination | None:
    terminated = (state or {}).get("terminated")
    if not terminated:
        return None
    return Termination(
        exit_code=terminated.get("exitCode"),
        reason=terminated.get("reason"),
        message=terminated.get("message"),
    )


def _adapter_roots(annotation: str | None) -> tuple[str, ...]:
    try:
        roots = json.loads(annotation or "[]")
    except ValueError:
        return ()
    return tuple(r for r in roots if isinstance(r, str)) if isinstance(roots, list) else ()


def pod_view(pod: Mapping[str, Any]) -> PodView:
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    engine_statuses = [
        s for s in status.get("containerStatuses") or [] if s.get("name") == "engine"
    ]
    engine = engine_statuses[0] if engine_statuses else {}
    state = engine.get("state") or {}
    annotations = metadata.get("annotations") or {}
    return PodView(
        name=metadata.get("name", ""),
        uid=metadata.get("uid", ""),
        digest=annotations.get(naming.DIGEST_ANNOTATION),
        ready=ready,
        ip=status.get("podIP"),
        terminating=metadata.get("deletionTimestamp") is not None,
        restart_count=int(engine.get("restartCount") or 0),
        waiting_reason=(state.get("waiting") or {}).get("reason"),
        terminated=_termination(state),
        last_terminated=_termination(engine.get("lastState")),
        replica_set=next(
            (
                ref.get("name")
                for ref in metadata.get("ownerReferences") or []
                if ref.get("kind") == "ReplicaSet" and ref.get("controller")
            ),
            None,
        ),
        template_hash=(metadata.get("labels") or {}).get(POD_TEMPLATE_HASH_LABEL),
        deletion_cost=annotations.get(DELETION_COST_ANNOTATION),
        adapter_roots=_adapter_roots(annotations.get(naming.ADAPTER_ROOTS_ANNOTATION)),
    )


def deployment_view(deployment: Mapping[str, Any]) -> DeploymentView:
    metadata = deployment.get("metadata") or {}
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    template_annotations = ((spec.get("template") or {}).get("metadata") or {}).get(
        "annotations"
    ) or {}
    return DeploymentView(
        generation=int(metadata.get("generation") or 0),
        observed_generation=int(status.get("observedGeneration") or 0),
        digest=template_annotations.get(naming.DIGEST_ANNOTATION),
        replicas=int(spec.get("replicas", 1)),
        status_replicas=int(status.get("replicas") or 0),
        ready_replicas=int(status.get("readyReplicas") or 0),
        updated_replicas=int(status.get("updatedReplicas") or 0),
        progress_deadline_exceeded=any(
            c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
            for c in status.get("conditions") or []
        ),
    )


def owned_pods(pods: Sequence[PodView], deployment: str) -> list[PodView]:
    """The pods of ``deployment``'s ReplicaSets: a pod that merely carries the pool label (a
    copy made for debugging, say) is neither counted, fingerprinted nor deleted."""
    return [p for p in pods if p.belongs_to(deployment)]
