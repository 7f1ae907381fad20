"""Pod status as the kubelet reports it: phase, conditions and container statuses."""

from __future__ import annotations

from .api import Json
from .container import Container
from .node import now


def phase(
    init: list[Container], main: list[Container], restart_policy: str, initialized: bool
) -> str:
    """Kubernetes' pod phase, derived from what the containers really do."""
    if not initialized:
        failed_init = any((c.terminated or {}).get("exitCode", 0) != 0 for c in init)
        return "Failed" if failed_init and restart_policy == "Never" else "Pending"
    if any(c.running for c in main):
        return "Running"
    if not all(c.attempts for c in main):
        return "Pending"
    if restart_policy == "Always" or any("waiting" in c.state for c in main):
        return "Running"  # between restarts
    failed = any(c.terminated and c.terminated["exitCode"] != 0 for c in main)
    return "Failed" if failed else "Succeeded"


def conditions(
    previous: list[Json], pod: Json, *, sandbox: bool, initialized: bool, containers_ready: bool
) -> list[Json]:
    """The pod's conditions; lastTransitionTime changes only when a status changes."""
    before = {c["type"]: c for c in previous}
    gates = [g["conditionType"] for g in pod["spec"].get("readinessGates", [])]
    gates_ok = all(before.get(g, {}).get("status") == "True" for g in gates)
    wanted = {
        "PodReadyToStartContainers": sandbox,
        "Initialized": initialized,
        "ContainersReady": containers_ready,
        "Ready": containers_ready and gates_ok,
    }
    result = [c for c in previous if c["type"] not in wanted]  # PodScheduled, readiness gates
    stamp = now()
    for kind, ok in wanted.items():
        status = "True" if ok else "False"
        old = before.get(kind)
        since = old["lastTransitionTime"] if old and old.get("status") == status else stamp
        cond: Json = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": since,
        }
        if not ok and kind in ("ContainersReady", "Ready"):
            cond["reason"] = "ContainersNotReady"
        result.append(cond)
    return result
