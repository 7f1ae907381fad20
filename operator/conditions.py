"""Status conditions following the Kubernetes API conventions, and the Events their changes raise."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
DRIFTED = "Drifted"
SERVED_NAME_CONFLICT = "ServedNameConflict"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED, DRIFTED, SERVED_NAME_CONFLICT)

# Conditions whose True status means something is wrong.
ABNORMAL_WHEN_TRUE = frozenset({DEGRADED, DRIFTED, SERVED_NAME_CONFLICT})
# Why a pool may stop being Ready because someone asked for it (a rollout, a new spec, zero
# replicas): a Normal Event, not a Warning.
PLANNED_NOT_READY_REASONS = frozenset({"RollingOut", "Reconciling", "ScaledToZero"})

Status = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Condition:
    """A condition as computed, before it gets its timestamps."""

    type: str
    status: Status
    reason: str
    message: str


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def merge_conditions(
    previous: Sequence[Mapping[str, Any]],
    desired: Iterable[Condition],
    *,
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """The new conditions list: ``lastTransitionTime`` moves only when a status flips.

    Conditions in ``previous`` that are not desired are kept as they were (another writer's).
    """
    by_type = {c["type"]: dict(c) for c in previous}
    for condition in desired:
        old = by_type.get(condition.type)
        flipped = old is None or old.get("status") != condition.status
        by_type[condition.type] = {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
            "lastTransitionTime": now if flipped or old is None else old["lastTransitionTime"],
            "observedGeneration": generation,
        }
    ordered = [by_type.pop(t) for t in CONDITION_TYPES if t in by_type]
    return ordered + [by_type[t] for t in sorted(by_type)]


def transition_events(
    previous: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]
) -> list[Event]:
    """One Event per condition whose status flipped, or that appeared in a bad state."""
    old_status = {c["type"]: c.get("status") for c in previous}
    events = []
    for condition in current:
        before = old_status.get(condition["type"])
        if before == condition["status"]:
            continue
        warning = _is_warning(condition["type"], condition["status"], condition["reason"], before)
        if before is None and not warning:
            continue  # a new pool's first, unremarkable conditions
        events.append(
            Event(
                type="Warning" if warning else "Normal",
                reason=condition["reason"],
                message=f"{condition['type']}={condition['status']}: {condition['message']}",
            )
        )
    return events


def _is_warning(condition_type: str, status: str, reason: str, before: str | None) -> bool:
    """Degraded or Drifted turning True, or a pool losing readiness it had for no planned reason."""
    if condition_type in ABNORMAL_WHEN_TRUE:
        return status == "True"
    planned = reason in PLANNED_NOT_READY_REASONS
    return condition_type == READY and before == "True" and not planned


def find(conditions: Sequence[Mapping[str, Any]], condition_type: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == condition_type), None)
