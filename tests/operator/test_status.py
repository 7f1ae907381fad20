"""Status computation: rollout state, Ready only after the rollout, Degraded reasons, patches."""

from __future__ import annotations

from llmpool.operator import naming, served_names
from llmpool.operator.admission import Refusal
from llmpool.operator.conditions import find
from llmpool.operator.drift import DriftEntry
from llmpool.operator.status import (
    Observation,
    compute_status,
    reconciled_status,
    rollout_state,
    short_revision,
    status_patch,
)
from llmpool.operator.views import deployment_view, owned_pods, pod_view

DIGEST = "sha256:" + "d" * 64
OLD = "sha256:" + "0" * 64
NOW = "2026-01-01T00:00:00Z"


def observe(make_pod, make_deployment, pods, deployment=None, **kwargs) -> Observation:
    fields = dict(
        pool="chat",
        revision="sha256:" + "2" * 64,
        generation=3,
        reconciled_generation=3,
        replicas=2,
        digest=DIGEST,
        deployment=deployment_view(deployment or make_deployment()),
        # As the operator passes them: only the pods of the pool's own Deployment.
        pods=owned_pods([pod_view(make_pod(name, **spec)) for name, spec in pods], "chat"),
    )
    fields.update(kwargs)
    return Observation(**fields)


def status_of(observation: Observation, previous: dict | None = None) -> dict:
    rollout = rollout_state(
        observation.deployment,
        observation.pods,
        digest=observation.digest,
        replicas=observation.replicas,
        reconciled=observation.reconciled_generation >= observation.generation,
    )
    return compute_status(observation, previous or {}, now=NOW, rollout=rollout)


def condition(status: dict, kind: str) -> tuple[str, str]:
    found = find(status["conditions"], kind)
    assert found is not None
    return found["status"], found["reason"]


def test_ready_when_every_replica_serves_the_digest(make_pod, make_deployment):
    status = status_of(observe(make_pod, make_deployment, [("a", {}), ("b", {})]))
    assert condition(status, "Ready") == ("True", "AllReplicasReady")
    assert condition(status, "Progressing") == ("False", "RolloutComplete")
    assert condition(status, "Degraded") == ("False", "AsExpected")
    assert condition(status, "Drifted") == ("Unknown", "NotChecked")
    assert status["replicas"] == status["readyReplicas"] == status["updatedReplicas"] == 2
    assert status["replicaSummary"] == "2/2"
    assert status["selector"] == "app.kubernetes.io/name=llmpool-engine,llmpool.dev/pool=chat"
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])


def test_not_ready_while_old_pods_remain(make_pod, make_deployment):
    """Counts can look complete while an old-template pod is still serving."""
    pods = [("a", {}), ("b", {}), ("old", {"digest": OLD})]
    deployment = make_deployment(status_replicas=3)
    status = status_of(observe(make_pod, make_deployment, pods, deployment))
    assert condition(status, "Ready") == ("False", "RollingOut")
    assert "old" in find(status["conditions"], "Ready")["message"]


def test_replicas_of_an_older_template_are_listed_as_outgoing(make_pod, make_deployment):
    """The same patch that carries the new pin says which replicas still hold an older one."""
    pods = [("b", {}), ("old-2", {"digest": OLD}), ("old-1", {"digest": OLD})]
    status = status_of(observe(make_pod, make_deployment, pods))
    assert status["outgoing"] == [
        {"pod": "old-1", "pinnedDigest": OLD},
        {"pod": "old-2", "pinnedDigest": OLD},
    ]
    done = status_of(observe(make_pod, make_deployment, [("a", {}), ("b", {})]), status)
    assert done["outgoing"] == []
    assert status_patch(status, done)["outgoing"] == []


def test_look_alike_pods_do_not_keep_the_pool_rolling_out(make_pod, make_deployment):
    """A pod with the pool label but no ReplicaSet of the pool (a debugging copy, say)."""
    pods = [("a", {}), ("b", {}), ("copy", {"digest": OLD, "replica_set": None})]
    pods.append(("other", {"digest": OLD, "replica_set": "someone-else-5c8d9f"}))
    status = status_of(observe(make_pod, make_deployment, pods))
    assert condition(status, "Ready") == ("True", "AllReplicasReady")
    assert condition(status, "Progressing") == ("False", "RolloutComplete")


def test_a_blocked_pool_is_neither_ready_nor_progressing(make_pod, make_deployment):
    blocked = Refusal("ImageNotAllowed", "spec.image evil:1 is not allowed")
    status = status_of(observe(make_pod, make_deployment, [("a", {}), ("b", {})], blocked=blocked))
    for kind, expected in (("Ready", "False"), ("Progressing", "False"), ("Degraded", "True")):
        assert condition(status, kind) == (expected, "ImageNotAllowed")
        assert find(status["conditions"], kind)["message"] == blocked.message


def test_drift_that_persists_is_degraded(make_pod, make_deployment):
    observation = observe(
        make_pod, make_deployment, [("a", {}), ("b", {})], drift_persists="3 recreation(s) ..."
    )
    assert condition(status_of(observation), "Degraded") == ("True", "DriftPersists")


def test_not_ready_before_the_deployment_controller_saw_the_template(make_pod, make_deployment):
    deployment = make_deployment(generation=2, observed_generation=1)
    status = status_of(observe(make_pod, make_deployment, [("a", {}), ("b", {})], deployment))
    assert condition(status, "Ready") == ("False", "RollingOut")


def test_not_ready_while_the_deployment_has_the_old_digest(make_pod, make_deployment):
    deployment = make_deployment(digest=OLD)
    status = status_of(observe(make_pod, make_deployment, [("a", {}), ("b", {})], deployment))
    assert condition(status, "Progressing") == ("True", "RollingOut")


def test_not_ready_until_updated_equals_ready_equals_replicas(make_pod, make_deployment):
    deployment = make_deployment(ready=1, updated=2)
    pods = [("a", {}), ("b", {"ready": False})]
    status = status_of(observe(make_pod, make_deployment, pods, deployment))
    assert condition(status, "Ready") == ("False", "ReplicasNotReady")
    assert status["replicaSummary"] == "1/2"


def test_not_ready_before_the_spec_was_reconciled(make_pod, make_deployment):
    observation = observe(
        make_pod, make_deployment, [("a", {}), ("b", {})], reconciled_generation=2
    )
    assert condition(status_of(observation), "Ready") == ("False", "Reconciling")


def test_scaled_to_zero(make_pod, make_deployment):
    deployment = make_deployment(replicas=0, ready=0, updated=0)
    status = status_of(observe(make_pod, make_deployment, [], deployment, replicas=0))
    assert condition(status, "Ready") == ("False", "ScaledToZero")


def test_no_deployment_yet(make_pod, make_deployment):
    observation = observe(make_pod, make_deployment, [])
    observation = Observation(**{**observation.__dict__, "deployment": None})
    status = status_of(observation)
    assert condition(status, "Ready") == ("False", "Reconciling")
    assert status["replicas"] == 0


def test_revision_mismatch_from_the_termination_message(make_pod, make_deployment):
    crashed = {
        "waiting": "CrashLoopBackOff",
        "ready": False,
        "last_terminated": {
            "exitCode": 3,
            "reason": "Error",
            "message": "RevisionMismatch: builtin://x has revision sha256:1, but sha256:2 was pinned\n",
        },
    }
    status = status_of(observe(make_pod, make_deployment, [("a", crashed), ("b", crashed)]))
    assert condition(status, "Degraded") == ("True", "RevisionMismatch")
    message = find(status["conditions"], "Degraded")["message"]
    assert "sha256:2 was pinned" in message and "pod a" in message
    assert condition(status, "Ready")[0] == "False"


def test_revision_mismatch_on_a_first_failure(make_pod, make_deployment):
    failed = {"ready": False, "terminated": {"exitCode": 3, "message": "RevisionMismatch: x"}}
    status = status_of(observe(make_pod, make_deployment, [("a", failed)]))
    assert condition(status, "Degraded") == ("True", "RevisionMismatch")


def test_revision_mismatch_without_a_termination_message(make_pod, make_deployment):
    failed = {"ready": False, "waiting": "CrashLoopBackOff", "last_terminated": {"exitCode": 3}}
    status = status_of(observe(make_pod, make_deployment, [("a", failed)]))
    message = find(status["conditions"], "Degraded")["message"]
    assert "sha256:" + "2" * 64 in message and "exit code 3" in message


def test_other_crash_loops(make_pod, make_deployment):
    crashed = {
        "waiting": "CrashLoopBackOff",
        "ready": False,
        "last_terminated": {"exitCode": 1, "message": "Traceback ...\nValueError: boom"},
    }
    status = status_of(observe(make_pod, make_deployment, [("a", crashed), ("b", {})]))
    assert condition(status, "Degraded") == ("True", "CrashLoopBackOff")
    assert "Traceback" in find(status["conditions"], "Degraded")["message"]


def test_configuration_problems_degrade(make_pod, make_deployment):
    observation = observe(
        make_pod, make_deployment, [("a", {}), ("b", {})], problems=["no template"]
    )
    assert condition(status_of(observation), "Degraded") == ("True", "InvalidConfiguration")


def test_drift_report(make_pod, make_deployment):
    entries = [DriftEntry("b", "chatTemplateSha256", "aa", "bb")]
    observation = observe(
        make_pod, make_deployment, [("a", {}), ("b", {})], drift=entries, checked_replicas=2
    )
    status = status_of(observation)
    assert condition(status, "Drifted") == ("True", "ReplicasDrifted")
    assert status["drift"] == [
        {"pod": "b", "field": "chatTemplateSha256", "expected": "aa", "actual": "bb"}
    ]
    clean = observe(make_pod, make_deployment, [("a", {}), ("b", {})], drift=[], checked_replicas=2)
    later = status_of(clean, status)
    assert condition(later, "Drifted") == ("False", "NoDrift")
    assert later["drift"] == []


def test_unchecked_drift_keeps_the_previous_report(make_pod, make_deployment):
    entries = [DriftEntry("b", "maxModelLen", "1", "2")]
    first = status_of(
        observe(
            make_pod, make_deployment, [("a", {}), ("b", {})], drift=entries, checked_replicas=2
        )
    )
    second = status_of(observe(make_pod, make_deployment, [("a", {}), ("b", {})]), first)
    assert "drift" not in second
    assert condition(second, "Drifted") == ("True", "ReplicasDrifted")


def test_quiet_pool_needs_no_patch(make_pod, make_deployment):
    observation = observe(make_pod, make_deployment, [("a", {}), ("b", {})])
    first = status_of(observation)
    assert status_patch(first, status_of(observation, first)) == {}


def test_status_patch_deletes_nested_keys_but_not_other_fields():
    previous = {"capacity": {"kvBytesPerToken": 1, "message": "old"}, "endpoint": "x", "other": 1}
    new = {"capacity": {"kvBytesPerToken": 1, "maxSequences": 2}, "endpoint": "x"}
    assert status_patch(previous, new) == {"capacity": {"maxSequences": 2, "message": None}}


def test_reconciled_status():
    pinned = {"revision": "sha256:" + "ab" * 32, "chatTemplateSha256": None}
    status = reconciled_status(
        pool="chat", namespace="team", generation=4, pinned=pinned, digest=DIGEST, capacity={}
    )
    assert status["observedGeneration"] == 4
    assert status["pinnedDigest"] == DIGEST
    assert status["endpoint"] == "http://chat.team.svc:8000/v1"
    assert status["shortRevision"] == "abababababab"
    assert status["selector"] == naming.selector_string("chat")


def test_short_revision_of_a_commit():
    assert short_revision("0123456789abcdef0123456789abcdef01234567") == "0123456789ab"


def test_rollout_state_counts_terminating_pods_out(make_pod, make_deployment):
    pods = [
        pod_view(make_pod("a")),
        pod_view(make_pod("b")),
        pod_view(make_pod("gone", digest=OLD, deleting=True)),
    ]
    rollout = rollout_state(
        deployment_view(make_deployment()), pods, digest=DIGEST, replicas=2, reconciled=True
    )
    assert rollout.complete and not rollout.in_progress


def test_no_ready_replica_means_drift_not_checked(make_pod, make_deployment):
    observation = observe(make_pod, make_deployment, [("a", {"ready": False})], drift=[])
    assert condition(status_of(observation), "Drifted") == ("Unknown", "NotChecked")


def test_a_served_name_claimed_in_another_namespace_is_a_conflict(make_pod, make_deployment):
    unique = status_of(observe(make_pod, make_deployment, [], served_name="smollm2"))
    assert condition(unique, "ServedNameConflict") == ("False", "Unique")
    claims = {"smollm2": [("team", "chat"), ("b", "x"), ("a", "y")]}
    rivals = served_names.rivals(claims, "smollm2", "team")
    assert rivals == ["a/y", "b/x"]
    # Claims are keyed by the normal form: every spelling of the name finds them.
    assert served_names.rivals(claims, "SmolLM2", "team") == rivals
    assert served_names.rivals(claims, "ｓｍｏｌｌｍ2", "team") == rivals
    assert served_names.rivals(claims, "smollm3", "team") == []
    observation = observe(
        make_pod, make_deployment, [], served_name="smollm2", served_name_rivals=rivals
    )
    status = status_of(observation)
    assert condition(status, "ServedNameConflict") == ("True", "ClaimedInOtherNamespaces")
    message = find(status["conditions"], "ServedNameConflict")["message"]
    assert "'smollm2'" in message and "a/y, b/x" in message
    # Reported even while the pool is blocked: a conflict is independent of its children.
    blocked = observe(
        make_pod,
        make_deployment,
        [],
        served_name="smollm2",
        served_name_rivals=rivals,
        blocked=Refusal("OwnershipConflict", "Service chat already exists"),
    )
    assert condition(status_of(blocked), "ServedNameConflict")[0] == "True"


def test_adapters_are_written_when_checked_and_kept_otherwise(make_pod, make_deployment):
    pods = [("a", {}), ("b", {})]
    served = [{"name": "sql", "revision": OLD, "replicas": ["a"], "readyReplicas": 1}]
    first = status_of(observe(make_pod, make_deployment, pods, adapters=served))
    assert first["adapters"] == served
    unchecked = status_of(observe(make_pod, make_deployment, pods), first)
    assert "adapters" not in unchecked  # the merge patch leaves the previous list
    emptied = status_of(observe(make_pod, make_deployment, pods, adapters=[]), first)
    assert emptied["adapters"] == []
    # A pool that never had adapters gets no empty list written on every check.
    assert "adapters" not in status_of(observe(make_pod, make_deployment, pods, adapters=[]))
