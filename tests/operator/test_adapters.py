"""operator/adapters.py: what to load, reload and unload on each replica, adapter drift and
status.adapters, from the replicas' /fingerprint answers."""

from __future__ import annotations

import dataclasses
import json

from llmpool.operator import naming
from llmpool.operator.adapters import (
    Action,
    Outcome,
    Replica,
    action_events,
    adapter_status,
    classify_adapter_drift,
    engine_path,
    in_order,
    mount_root,
    plan_actions,
    readable,
    replicas,
)
from llmpool.operator.drift import DriftEntry, Fingerprint, pods_to_recreate
from llmpool.operator.spec import AdapterSpec
from llmpool.operator.views import PodView, pod_view

DIGEST = "sha256:" + "d" * 64  # the current template's pin (conftest's pods carry it)
OLD_DIGEST = "sha256:" + "0" * 64
REV_A = "sha256:" + "a" * 64
REV_A2 = "sha256:" + "2" * 64
REV_B = "sha256:" + "b" * 64
TAMPERED = "sha256:" + "f" * 64
ROOTS = ("/models/pvc/tuned", "/var/lib/adapters")
A = AdapterSpec("a", "file:///var/lib/adapters/a", REV_A)
B = AdapterSpec("b", "pvc://tuned/b", REV_B)


def served(*adapters: tuple[str, str]) -> list[dict]:
    return [{"name": name, "digest": digest, "revision": digest} for name, digest in adapters]


def failure(
    name: str, revision: str, digest: str | None = TAMPERED, code: str = "revision_mismatch"
):
    return {"name": name, "revision": revision, "digest": digest, "code": code, "error": "..."}


def replica(pod: str, adapters=(), failures=(), roots=ROOTS) -> Replica:
    body = {"adapters": served(*adapters), "adapterFailures": list(failures)}
    return Replica(pod, {"digest": DIGEST, "lora": {"maxLoras": 4}, **body}, roots)


def kinds(actions: list[Action]) -> list[tuple[str, str, str]]:
    return [(a.pod, a.kind, a.adapter) for a in actions]


def plan(adapters, current, max_reloading_pods=1, retry_failed=False) -> list[Action]:
    return plan_actions(
        adapters, current, max_reloading_pods=max_reloading_pods, retry_failed=retry_failed
    )


def test_engine_paths_and_mount_roots():
    assert engine_path("file:///var/lib/adapters/a") == "/var/lib/adapters/a"
    assert engine_path("pvc://tuned/b/v2") == "/models/pvc/tuned/b/v2"
    assert engine_path("/opt/adapters/c") == "/opt/adapters/c"
    assert mount_root("file:///var/lib/adapters/a/") == "/var/lib/adapters"
    assert mount_root("pvc://tuned/b/v2") == "/models/pvc/tuned"
    assert mount_root("/opt/adapters/c") is None
    assert readable(A, ROOTS) and readable(B, ROOTS)
    assert not readable(A, ("/models/pvc/tuned",)) and not readable(A, ("/var/lib/adapter",))
    assert readable(AdapterSpec("c", "/opt/adapters/c", REV_B), ())  # in the image


def test_new_adapters_are_loaded_on_every_replica_that_lacks_them():
    current = [replica("p1", [("a", REV_A)]), replica("p2")]
    actions = plan([A, B], current)
    assert kinds(actions) == [("p1", "load", "b"), ("p2", "load", "a"), ("p2", "load", "b")]
    assert actions[1].path == "/v1/load_lora_adapter"
    assert actions[1].body == {
        "lora_name": "a",
        "lora_path": "/var/lib/adapters/a",
        "revision": REV_A,
    }
    assert actions[2].body["lora_path"] == "/models/pvc/tuned/b"
    assert plan([A, B], [replica("p1", [("a", REV_A), ("b", REV_B)])]) == []


def test_adapters_gone_from_the_spec_are_unloaded_first():
    current = [replica("p1", [("a", REV_A), ("old", REV_B)]), replica("p2", [("old", REV_B)])]
    actions = plan([A], current)
    assert kinds(actions) == [("p1", "unload", "old"), ("p2", "unload", "old"), ("p2", "load", "a")]
    assert actions[0].path == "/v1/unload_lora_adapter"
    assert actions[0].body == {"lora_name": "old"}
    groups = in_order(list(reversed(actions)))
    assert [[a.kind for a in group] for group in groups] == [["unload", "unload"], ["load"]]


def test_a_new_revision_is_swapped_in_place_on_max_unavailable_replicas_per_pass():
    swapped = dataclasses.replace(A, revision=REV_A2)
    current = [replica(p, [("a", REV_A), ("b", REV_B)]) for p in ("p1", "p2", "p3")]
    actions = plan([swapped, B], current, max_reloading_pods=1)
    assert kinds(actions) == [("p1", "reload", "a")]
    assert actions[0].body == {
        "lora_name": "a",
        "lora_path": "/var/lib/adapters/a",
        "revision": REV_A2,
        "load_inplace": True,
    }
    assert kinds(plan([swapped, B], current, max_reloading_pods=2)) == [
        ("p1", "reload", "a"),
        ("p2", "reload", "a"),
    ]
    assert len(plan([swapped, B], current, max_reloading_pods=0)) == 1  # never stuck
    # The swapped replica no longer counts: the next pass takes the next one.
    current[0] = replica("p1", [("a", REV_A2), ("b", REV_B)])
    assert kinds(plan([swapped, B], current)) == [("p2", "reload", "a")]
    # Loads of missing adapters are not held back by the swaps.
    current.append(replica("p4"))
    assert kinds(plan([swapped, B], current)) == [
        ("p2", "reload", "a"),
        ("p4", "load", "a"),
        ("p4", "load", "b"),
    ]


def test_a_tampered_adapter_is_drift_naming_the_adapter():
    current = [
        replica("p1", [("a", REV_A), ("b", REV_B)]),
        replica("p2", [("b", REV_B)], failures=[failure("a", REV_A)]),
    ]
    entries = classify_adapter_drift([A, B], current)
    assert entries == [DriftEntry("p2", "adapters.a", REV_A, TAMPERED)]
    assert entries[0].as_status() == {
        "pod": "p2",
        "field": "adapters.a",
        "expected": REV_A,
        "actual": TAMPERED,
    }
    # Not tried again on every pass; once per drift interval.
    assert plan([A, B], current, retry_failed=False) == []
    assert kinds(plan([A, B], current, retry_failed=True)) == [("p2", "load", "a")]
    # The existing remediation applies: policy Recreate may delete the drifted pod.
    pods = [pod_view_named(name) for name in ("p1", "p2")]
    victims = pods_to_recreate(
        entries, pods, digest=DIGEST, replicas=2, max_unavailable=1, rollout_in_progress=False
    )
    assert victims == ["p2"]


def test_a_failed_swap_is_drift_with_the_digest_still_served():
    swapped = dataclasses.replace(A, revision=REV_A2)
    current = [replica("p1", [("a", REV_A)], failures=[failure("a", REV_A2)])]
    assert classify_adapter_drift([swapped], current) == [
        DriftEntry("p1", "adapters.a", REV_A2, REV_A)
    ]
    unreadable = [
        replica("p1", failures=[failure("a", REV_A, digest=None, code="invalid_adapter")])
    ]
    [entry] = classify_adapter_drift([A], unreadable)
    assert entry.actual == "load failed: invalid_adapter"


def test_loading_and_swapping_are_not_drift():
    swapped = dataclasses.replace(A, revision=REV_A2)
    loading = [replica("p1"), replica("p2", [("a", REV_A)])]
    assert classify_adapter_drift([A], loading) == []
    assert classify_adapter_drift([swapped], loading) == []  # swap pending on p2
    # A refusal of an older revision says nothing about the pinned one: load it again.
    stale = [replica("p1", failures=[failure("a", REV_A)])]
    assert classify_adapter_drift([swapped], stale) == []
    assert kinds(plan([swapped], stale)) == [("p1", "load", "a")]
    # An adapter being unloaded is not drift either.
    assert classify_adapter_drift([], [replica("p1", [("a", REV_A)])]) == []


def pod_view_named(name: str, digest: str = DIGEST, roots=ROOTS) -> PodView:
    return dataclasses.replace(
        pod_view({"metadata": {"name": name}, "status": {"conditions": []}}),
        digest=digest,
        ready=True,
        ip="10.0.0.1",
        adapter_roots=roots,
    )


def fingerprint(pod: str, template: str = DIGEST, lora: bool = True, adapters=()) -> Fingerprint:
    body = {"digest": template, "lora": {"maxLoras": 4} if lora else None}
    return Fingerprint(pod, template, {**body, "adapters": served(*adapters)})


def test_only_replicas_of_the_current_template_with_lora_on_are_managed():
    pods = [
        pod_view_named("new"),
        pod_view_named("outgoing", digest=OLD_DIGEST),
        pod_view_named("lora-off"),
        pod_view_named("unmounted", roots=()),
    ]
    found = [
        fingerprint("new"),
        fingerprint("outgoing", template=OLD_DIGEST, adapters=[("x", REV_B)]),
        fingerprint("lora-off", lora=False),
        fingerprint("unmounted"),
        fingerprint("not-a-pod-of-the-pool"),
    ]
    current = replicas(found, pods, DIGEST)
    assert [r.pod for r in current] == ["new", "unmounted"]
    assert current[0].roots == ROOTS
    # A pod of an older ReplicaSet that does not mount an adapter's root is not asked to load
    # it, nor drifted on it; an adapter baked in the image needs no mount.
    in_image = AdapterSpec("c", "/opt/adapters/c", REV_B)
    assert kinds(plan([A, in_image], current)) == [
        ("new", "load", "a"),
        ("new", "load", "c"),
        ("unmounted", "load", "c"),
    ]
    refused = [dataclasses.replace(replica("unmounted", failures=[failure("a", REV_A)]), roots=())]
    assert classify_adapter_drift([A], refused) == []


def test_pods_read_their_adapter_roots_from_the_template(make_pod):
    body = make_pod("p1")
    body["metadata"]["annotations"][naming.ADAPTER_ROOTS_ANNOTATION] = json.dumps(list(ROOTS))
    assert pod_view(body).adapter_roots == ROOTS
    assert pod_view(make_pod("p2")).adapter_roots == ()


def test_status_lists_the_replicas_serving_each_pinned_revision():
    found = [
        fingerprint("p1", adapters=[("a", REV_A), ("b", REV_B)]),
        fingerprint("p2", adapters=[("a", REV_A2)]),
        fingerprint("p0", template=OLD_DIGEST, adapters=[("a", REV_A)]),
    ]
    assert adapter_status([A, B], found) == [
        {"name": "a", "revision": REV_A, "replicas": ["p0", "p1"], "readyReplicas": 2},
        {"name": "b", "revision": REV_B, "replicas": ["p1"], "readyReplicas": 1},
    ]
    assert adapter_status([], found) == []


def test_outcomes_read_the_engines_error():
    load = Action("p1", "load", "a", {"lora_name": "a", "revision": REV_A})
    assert Outcome.of(load, 200, "Success: LoRA adapter 'a' added successfully.").ok
    error = {"error": {"code": "revision_mismatch", "message": "files are sha256:f..."}}
    refused = Outcome.of(load, 400, json.dumps(error))
    assert not refused.ok
    assert refused.error == "HTTP 400 revision_mismatch: files are sha256:f..."
    assert Outcome.of(load, 502, "<html>bad gateway</html>").error == (
        "HTTP 502 <html>bad gateway</html>"
    )


def test_events_say_what_the_replicas_report_after_the_actions():
    load = Action("p1", "load", "a", {"lora_name": "a", "revision": REV_A})
    load2 = Action("p2", "load", "a", {"lora_name": "a", "revision": REV_A})
    unload = Action("p1", "unload", "old", {"lora_name": "old"})
    refused = Action("p3", "load", "a", {"lora_name": "a", "revision": REV_A})
    again = Action("p4", "load", "a", {"lora_name": "a", "revision": REV_A})
    before = [
        replica("p1", [("old", REV_B)]),
        replica("p2"),
        replica("p3"),
        replica("p4", failures=[failure("a", REV_A)]),
    ]
    after = [
        replica("p1", [("a", REV_A)]),
        replica("p2", [("a", REV_A)]),
        replica("p3", failures=[failure("a", REV_A)]),
        replica("p4", failures=[failure("a", REV_A)]),
    ]
    outcomes = [
        Outcome(load, 200),
        Outcome(load2, 200),
        Outcome(unload, 200),
        Outcome(refused, 400, "HTTP 400 revision_mismatch: no"),
        Outcome(again, 400, "HTTP 400 revision_mismatch: no"),
    ]
    events = action_events(outcomes, before=before, after=after)
    assert [(e.type, e.reason, e.message) for e in events] == [
        ("Normal", "AdapterLoaded", f"adapter a loaded at {REV_A} on p1, p2"),
        ("Normal", "AdapterUnloaded", "adapter old unloaded from p1"),
        (
            "Warning",
            "AdapterLoadFailed",
            "adapter a refused by p3 (HTTP 400 revision_mismatch: no)",
        ),
    ]
