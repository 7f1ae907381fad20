"""A pool's LoRA adapters on its replicas: what to load, reload or unload on each one, which
replicas drifted on an adapter, and ``status.adapters``; pure functions of the spec and the
replicas' ``/fingerprint`` answers.

Adapters are outside the pin (``llmpool.pinning``): the pod template carries only the slots
(``--enable-lora --max-loras --max-lora-rank``) and the volumes of the adapters' roots, and the
operator loads each adapter over HTTP (``POST /v1/load_lora_adapter``), so adding or removing
one never restarts a pod. A replica's ``/fingerprint`` lists what it serves (``adapters``, each
with the sha256 ``digest`` of its files) and the loads it refused (``adapterFailures``), so the
operator judges every replica from what the replica itself reports.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from llmpool.operator.conditions import Event
from llmpool.operator.drift import DriftEntry, Fingerprint
from llmpool.operator.spec import AdapterSpec
from llmpool.operator.views import PodView
from llmpool.pinning import PVC_MOUNT_ROOT

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
FIELD_PREFIX = "adapters."
MAX_ERROR_CHARS = 200

ActionKind = Literal["load", "reload", "unload"]


def engine_path(source: str) -> str:
    """The folder an engine pod reads an adapter ``source`` from: ``pvc://claim/path`` under
    the claim's mount (as the model's), ``file:///path`` at the same path (a hostPath volume),
    and a path baked in the image as it is."""
    if source.startswith("pvc://"):
        return f"{PVC_MOUNT_ROOT}/{source.removeprefix('pvc://')}"
    return source.removeprefix("file://")


def mount_root(source: str) -> str | None:
    """The folder pods mount for an adapter ``source``: a PVC's mount (as the model's), or the
    parent of a node path, so that sibling adapters share one volume; None for a path in the
    image."""
    if source.startswith("pvc://"):
        return f"{PVC_MOUNT_ROOT}/{source.removeprefix('pvc://').split('/', 1)[0]}"
    if source.startswith("file://"):
        return posixpath.dirname(posixpath.normpath(source.removeprefix("file://")))
    return None


def under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (both normalized, so ``..`` cannot climb out)."""
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def readable(adapter: AdapterSpec, roots: Iterable[str]) -> bool:
    """Whether a pod that mounts ``roots`` can read ``adapter``'s folder."""
    if mount_root(adapter.source) is None:
        return True
    path = engine_path(adapter.source)
    return any(under(path, root) for root in roots)


@dataclass(frozen=True)
class Replica:
    """A pod of the current template, LoRA on, with its fingerprint and mounted adapter roots."""

    pod: str
    body: Mapping[str, Any]
    roots: tuple[str, ...]

    def served(self) -> dict[str, str | None]:
        """The digest of each adapter the replica serves, by name."""
        return {a["name"]: a.get("digest") for a in self.body.get("adapters") or []}

    def failures(self) -> dict[str, Mapping[str, Any]]:
        """The last refused load of each adapter, by name."""
        return {f["name"]: f for f in self.body.get("adapterFailures") or []}

    def failed(self, adapter: AdapterSpec) -> Mapping[str, Any] | None:
        """The replica's refusal of exactly this adapter's name and revision, if any. (A load
        refused for the slot table, full or the name taken, is a 409 the engine does not record:
        it is tried again at the next check, and is never drift.)"""
        failure = self.failures().get(adapter.name)
        if failure is None or failure.get("revision") != adapter.revision:
            return None
        return failure


def replicas(
    fingerprints: Iterable[Fingerprint], pods: Sequence[PodView], digest: str
) -> list[Replica]:
    """The replicas adapters are managed on: pods of the current template (``digest``) whose
    engine runs with LoRA on. A pod of an older template (a rollout, or the roll that turned
    LoRA on) is left alone until it is replaced."""
    by_name = {p.name: p for p in pods}
    found = []
    for fingerprint in fingerprints:
        pod = by_name.get(fingerprint.pod)
        if pod is None or pod.digest != digest or fingerprint.template_digest != digest:
            continue
        if not fingerprint.body.get("lora"):
            continue
        found.append(Replica(fingerprint.pod, fingerprint.body, pod.adapter_roots))
    return sorted(found, key=lambda r: r.pod)


@dataclass(frozen=True)
class Action:
    """One POST to one replica."""

    pod: str
    kind: ActionKind
    adapter: str
    body: dict[str, Any]

    @property
    def path(self) -> str:
        return UNLOAD_PATH if self.kind == "unload" else LOAD_PATH


def _load(pod: str, adapter: AdapterSpec, inplace: bool) -> Action:
    body: dict[str, Any] = {
        "lora_name": adapter.name,
        "lora_path": engine_path(adapter.source),
        "revision": adapter.revision,
    }
    if inplace:
        body["load_inplace"] = True
    return Action(pod, "reload" if inplace else "load", adapter.name, body)


def plan_actions(
    adapters: Sequence[AdapterSpec],
    current: Sequence[Replica],
    *,
    max_reloading_pods: int,
    retry_failed: bool,
) -> list[Action]:
    """What to POST to each replica this pass.

    - load: an adapter of the spec that the replica can read and does not serve;
    - reload (``load_inplace``): one it serves with a digest other than the pinned revision (a
      revision change is a rollout of that adapter): on at most ``max_reloading_pods`` replicas
      per pass (``rollout.maxUnavailable``, at least one), so the others keep serving the old
      one while the first swap;
    - unload: one the replica serves that the spec no longer names.

    A load or reload the replica refused for this revision (``adapterFailures``) is drift, and
    is tried again only when ``retry_failed`` (once per drift interval), not on every pass.
    """
    actions: list[Action] = []
    reloading: set[str] = set()
    wanted = {a.name for a in adapters}
    for replica in current:
        served = replica.served()
        actions += [
            Action(replica.pod, "unload", name, {"lora_name": name})
            for name in sorted(served)
            if name not in wanted
        ]
        for adapter in adapters:
            digest = served.get(adapter.name, "")
            if digest == adapter.revision or not readable(adapter, replica.roots):
                continue
            if not retry_failed and replica.failed(adapter) is not None:
                continue
            inplace = adapter.name in served
            if inplace:
                if replica.pod not in reloading and len(reloading) >= max(max_reloading_pods, 1):
                    continue
                reloading.add(replica.pod)
            actions.append(_load(replica.pod, adapter, inplace))
    return actions


@dataclass(frozen=True)
class Outcome:
    """A replica's answer to one action: the HTTP status (None: no answer) and, when it is not
    a success, why."""

    action: Action
    status: int | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @classmethod
    def of(cls, action: Action, status: int, text: str) -> Outcome:
        """From an HTTP answer; an error's OpenAI-shaped body gives its code and message."""
        if 200 <= status < 300:
            return cls(action, status)
        try:
            error = json.loads(text).get("error") or {}
            detail = f"{error.get('code')}: {error.get('message')}"
        except (ValueError, AttributeError):
            detail = text[:MAX_ERROR_CHARS]
        return cls(action, status, f"HTTP {status} {detail}")


def in_order(actions: Sequence[Action]) -> list[list[Action]]:
    """The actions in the groups they are sent in: unloads first, so their slots are free for
    the loads; each group at once."""
    unloads = [a for a in actions if a.kind == "unload"]
    loads = [a for a in actions if a.kind != "unload"]
    return [group for group in (unloads, loads) if group]


def _pods(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


def action_events(
    outcomes: Sequence[Outcome], *, before: Sequence[Replica], after: Sequence[Replica]
) -> list[Event]:
    """One Event per adapter and result, naming the pods: ``AdapterLoaded`` and
    ``AdapterUnloaded`` for what the replicas report once acted on, ``AdapterLoadFailed`` for a
    refusal a replica had not already reported (a retry that fails again is not news)."""
    served_after = {r.pod: r.served() for r in after}
    failed_before = {r.pod: r.failures() for r in before}
    loaded: dict[tuple[str, str], list[str]] = {}
    unloaded: dict[str, list[str]] = {}
    failed: dict[str, list[str]] = {}
    for outcome in outcomes:
        action = outcome.action
        revision = action.body.get("revision")
        served = served_after.get(action.pod, {})
        if action.kind == "unload":
            if action.adapter not in served:
                unloaded.setdefault(action.adapter, []).append(action.pod)
        elif revision is not None and served.get(action.adapter) == revision:
            how = f"{'swapped in place to' if action.kind == 'reload' else 'loaded at'} {revision}"
            loaded.setdefault((action.adapter, how), []).append(action.pod)
        elif not outcome.ok:
            previous = failed_before.get(action.pod, {}).get(action.adapter) or {}
            if previous.get("revision") != revision:
                failed.setdefault(action.adapter, []).append(f"{action.pod} ({outcome.error})")
    events = [
        Event("Normal", "AdapterLoaded", f"adapter {name} {how} on {_pods(pods)}")
        for (name, how), pods in sorted(loaded.items())
    ]
    events += [
        Event("Normal", "AdapterUnloaded", f"adapter {name} unloaded from {_pods(pods)}")
        for name, pods in sorted(unloaded.items())
    ]
    events += [
        Event("Warning", "AdapterLoadFailed", f"adapter {name} refused by {_pods(pods)}")
        for name, pods in sorted(failed.items())
    ]
    return events


def _actual(replica: Replica, adapter: AdapterSpec) -> str | None:
    """What a replica has of ``adapter`` when it refused its revision: the digest it serves
    (a failed swap), else the digest of the files it found, else the refusal's code."""
    failure = replica.failed(adapter)
    if failure is None:
        return None
    served = replica.served().get(adapter.name)
    return served or failure.get("digest") or f"load failed: {failure.get('code')}"


def classify_adapter_drift(
    adapters: Sequence[AdapterSpec], current: Sequence[Replica]
) -> list[DriftEntry]:
    """``adapters.<name>`` entries of the replicas that refused an adapter's pinned revision
    (missing, or still serving another digest after a failed swap). An adapter that a replica
    lacks or serves at another digest without having refused the revision is being loaded or
    swapped, not drift; one that it serves beyond the spec is being unloaded."""
    entries = []
    for replica in current:
        served = replica.served()
        for adapter in adapters:
            if served.get(adapter.name) == adapter.revision:
                continue
            actual = _actual(replica, adapter)
            if actual is not None and readable(adapter, replica.roots):
                entries.append(
                    DriftEntry(replica.pod, FIELD_PREFIX + adapter.name, adapter.revision, actual)
                )
    return entries


def adapter_status(
    adapters: Sequence[AdapterSpec], fingerprints: Iterable[Fingerprint]
) -> list[dict[str, Any]]:
    """``status.adapters``: each adapter of the spec with the replicas that serve its pinned
    revision (only ready replicas answer ``/fingerprint``)."""
    served = [
        (f.pod, {a.get("name"): a.get("digest") for a in f.body.get("adapters") or []})
        for f in fingerprints
    ]
    result = []
    for adapter in adapters:
        pods = sorted(
            pod for pod, by_name in served if by_name.get(adapter.name) == adapter.revision
        )
        result.append(
            {
                "name": adapter.name,
                "revision": adapter.revision,
                "replicas": pods,
                "readyReplicas": len(pods),
            }
        )
    return result
