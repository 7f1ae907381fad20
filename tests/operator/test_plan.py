"""``plan``: one pass's decisions from an observation, checked as data (no API server, no HTTP,
no kopf handler machinery). tests/operator/test_converge.py runs the same passes through the
executor against an in-memory API."""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Any

import pytest

from llmpool.load import Demand
from llmpool.operator import admission
from llmpool.operator.children import child_view
from llmpool.operator.conditions import find
from llmpool.operator.drift import DriftEntry
from llmpool.operator.plan import (
    RESTORE_GRACE_SECONDS,
    DriftCheck,
    Observed,
    Plan,
    PoolObject,
    drift_check_due,
    plan,
    restore_due,
)
from llmpool.operator.pool_state import PoolState, Rejection
from llmpool.operator.views import deployment_view, pod_view

POLICY = admission.Policy.default("llmpool:latest")
NOW = 1_800_000_000.0
CHILDREN = ["ConfigMap", "Service", "PodDisruptionBudget", "LLMPoolDemand", "Deployment"]


@pytest.fixture
def body(chat_pool) -> dict[str, Any]:
    pool = copy.deepcopy(chat_pool)
    pool["metadata"].update(namespace="team", uid="uid-pool", generation=1)
    return pool


def observed(**fields: Any) -> Observed:
    defaults: dict[str, Any] = {
        "pods": [],
        "deployment": None,
        "wall": NOW,
        "monotonic": 1000.0,
        "chat_template": "{{ messages }}",
    }
    return Observed(**{**defaults, **fields})


def first_pass(body: dict[str, Any], **fields: Any) -> tuple[PoolObject, Observed, Plan]:
    pool, seen = PoolObject.from_body(body), observed(**fields)
    return pool, seen, plan(pool, seen, PoolState(), policy=POLICY)


def applied(body: dict[str, Any], first: Plan) -> dict[str, Any]:
    """The pool once ``first`` was carried out: its status patched."""
    after = copy.deepcopy(body)
    after["status"] = {k: v for k, v in first.status_patch.items() if v is not None}
    return after


def condition(patch: dict[str, Any], kind: str) -> tuple[str, str]:
    found = find(patch["conditions"], kind) or {}
    return found.get("status", ""), found.get("reason", "")


def test_a_new_pool_gets_every_child_in_order_and_its_pin(body):
    _, _, first = first_pass(body)
    assert [child.body["kind"] for child in first.children] == CHILDREN
    assert all(child.restored == "" for child in first.children)
    owner = first.children[0].body["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-pool" and owner["controller"]
    assert [e.reason for e in first.events] == ["Reconciled"]
    assert first.status_patch["observedGeneration"] == 1
    assert first.status_patch["pinnedDigest"] == first.digest
    assert first.metrics.desired_replicas == first.children[-1].body["spec"]["replicas"]
    assert first.pods_to_delete == [] and first.deletion_costs == {}
    assert first.state.chat_template is not None  # the template read is remembered


def test_a_quiet_pass_applies_nothing_and_patches_nothing_new(body):
    pool, seen, first = first_pass(body)
    live = {
        f"{c.body['kind']}/{c.body['metadata']['name']}": child_view(c.body) for c in first.children
    }
    later = replace(seen, children=live, monotonic=seen.monotonic + RESTORE_GRACE_SECONDS)
    again = plan(PoolObject.from_body(applied(body, first)), later, first.state, policy=POLICY)
    assert again.children == [] and again.events == []
    assert "pinnedDigest" not in again.status_patch


def test_a_deleted_child_is_restored_once_the_indexes_caught_up(body):
    _, seen, first = first_pass(body)
    live = {
        f"{c.body['kind']}/{c.body['metadata']['name']}": child_view(c.body) for c in first.children
    }
    del live["Service/smollm2-chat"]
    pool = PoolObject.from_body(applied(body, first))
    state = replace(first.state, applied_at=seen.monotonic)
    too_soon = plan(pool, replace(seen, children=live), state, policy=POLICY)
    assert too_soon.children == []  # the index may not show the operator's own apply yet
    later = replace(seen, children=live, monotonic=seen.monotonic + RESTORE_GRACE_SECONDS)
    restored = plan(pool, later, state, policy=POLICY)
    assert [(c.body["kind"], bool(c.restored)) for c in restored.children] == [("Service", True)]


def test_a_spec_the_api_server_refused_is_not_sent_again(body):
    pool, seen, first = first_pass(body)
    state = replace(PoolState(), rejected=Rejection(1, str(first.digest), "Deployment: invalid"))
    refused = plan(pool, seen, state, policy=POLICY)
    assert refused.children == []
    assert condition(refused.status_patch, "Degraded") == ("True", "ApplyRejected")
    assert "pinnedDigest" not in refused.status_patch
    assert [e.reason for e in refused.transition_events] == ["ApplyRejected"]
    assert refused.state.rejected == state.rejected  # kept until a spec goes through


def test_an_object_in_the_way_blocks_every_child(body):
    pool, seen, _ = first_pass(body)
    blocked = plan(pool, replace(seen, conflict="Service x exists"), PoolState(), policy=POLICY)
    assert blocked.children == []
    assert condition(blocked.status_patch, "Degraded") == ("True", "OwnershipConflict")


def test_a_missing_chat_template_is_a_problem_not_an_apply(body):
    missing = "chat template ConfigMap team/t with key 'template' not found"
    _, _, first = first_pass(body, chat_template=None, template_missing=missing)
    assert first.children == []
    degraded = find(first.status_patch["conditions"], "Degraded") or {}
    assert missing in degraded["message"]


def test_recreate_deletes_one_drifted_pod_at_a_time(body, make_pod, make_deployment):
    body["spec"]["drift"] = {"policy": "Recreate", "intervalSeconds": 30}
    body["spec"]["replicas"] = 3
    _, seen, first = first_pass(body)
    digest = str(first.digest)
    pods = [pod_view(make_pod(n, digest=digest, replica_set="smollm2-chat-5c8d9f")) for n in "abc"]
    deployment = deployment_view(make_deployment(digest=digest, replicas=3, ready=3, updated=3))
    entries = [DriftEntry(p, "digest", digest, "sha256:" + "e" * 64) for p in ("a", "b")]
    check = DriftCheck(entries, checked=3, adapters=[])
    later = replace(seen, pods=pods, deployment=deployment, drift=check, monotonic=2000.0)
    verdict = plan(PoolObject.from_body(applied(body, first)), later, first.state, policy=POLICY)
    assert verdict.pods_to_delete == [("a", "uid-a")]  # maxUnavailable 1
    assert verdict.status_patch["driftRecreations"] == 1
    assert [e.reason for e in verdict.events] == ["DriftDetected", "DriftDetected"]
    assert verdict.metrics.drifted_replicas == 2
    assert verdict.state.last_drift_check == 2000.0


def test_a_held_request_scales_an_idle_pool_from_zero(body):
    body["spec"].pop("replicas", None)
    body["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 3}
    pool, seen, first = first_pass(body)
    assert first.children[-1].body["spec"]["replicas"] == 0
    demand = {"gateway-a": Demand(held=2, at=NOW)}
    woken = plan(
        PoolObject.from_body(applied(body, first)),
        replace(seen, demand=demand, monotonic=seen.monotonic + RESTORE_GRACE_SECONDS),
        first.state,
        policy=POLICY,
    )
    assert [c.body["kind"] for c in woken.children] == ["Deployment"]
    assert woken.children[0].body["spec"]["replicas"] == 1
    assert [e.reason for e in woken.events] == ["ScaledFromZero"]
    assert woken.metrics.scaled == "ScaledFromZero"
    assert woken.status_patch["autoscaling"]["desiredReplicas"] == 1


def test_deletion_costs_follow_the_load(body, make_pod):
    pods = [pod_view(make_pod(n, replica_set="smollm2-chat-5c8d9f")) for n in ("busy", "idle")]
    _, _, first = first_pass(body, pods=pods, loads={"busy": 3.0, "idle": 0.0})
    assert first.deletion_costs == {"busy": "3", "idle": "0"}


def test_gone_gateways_records_are_pruned(body):
    demand = {"alive": Demand(held=1, at=NOW), "gone": Demand(held=3, at=NOW - 3600)}
    _, _, first = first_pass(body, demand=demand)
    assert first.stale_demand == ["gone"]


def test_drift_check_timing(body, make_pod):
    body["spec"]["drift"] = {"policy": "Report", "intervalSeconds": 30}
    body["status"] = {"observedGeneration": 1, "pinnedDigest": "sha256:" + "d" * 64}
    pool = PoolObject.from_body(body)
    pods = [pod_view(make_pod("a")), pod_view(make_pod("b"))]

    def checked(state: PoolState, pods: list, at: float) -> tuple[bool, PoolState]:
        due = drift_check_due(pool, pods, state, at)
        seen = observed(pods=pods, monotonic=at, drift=DriftCheck([], 0, []) if due else None)
        return due, plan(pool, seen, state, policy=POLICY).state

    due, state = checked(PoolState(), pods, 1000.0)
    assert due  # first look
    due, state = checked(state, pods, 1005.0)
    assert not due  # nothing changed, interval not over
    restarted = [pods[0], pod_view(make_pod("b", restart_count=1))]
    due, state = checked(state, restarted, 1005.0)
    assert due  # a pod restarted: check now
    due, state = checked(state, restarted, 1015.0)
    assert not due
    due, state = checked(state, restarted, 1045.0)
    assert due  # the interval is over
    unready = [restarted[0], pod_view(make_pod("b", restart_count=1, ready=False))]
    assert drift_check_due(pool, unready, state, 1045.0)
    # Not before the pin is applied.
    assert not drift_check_due(PoolObject.from_body({**body, "status": {}}), pods, PoolState(), 0)


def test_restore_waits_for_the_index_to_see_a_fresh_apply():
    assert restore_due(PoolState(), 100.0)  # never applied by this process
    state = PoolState(applied_at=100.0)
    assert not restore_due(state, 100.0)
    assert restore_due(state, 100.0 + RESTORE_GRACE_SECONDS)


def test_plan_reads_no_clock(body, monkeypatch):
    _, seen, first = first_pass(body)
    monkeypatch.setattr(time, "time", lambda: 0.0)
    monkeypatch.setattr(time, "monotonic", lambda: 0.0)
    assert plan(PoolObject.from_body(body), seen, PoolState(), policy=POLICY) == first
