"""The little logic kept in the kopf handlers: when a fingerprint check is due."""

from __future__ import annotations

import kopf

from llmpool.operator import handlers
from llmpool.operator.handlers import _drift_check_due, _restore_due, replica_change
from llmpool.operator.spec import PoolSpec
from llmpool.operator.views import pod_view


def test_drift_check_timing(chat_spec, make_pod, monkeypatch):
    pool = PoolSpec.from_dict({**chat_spec, "drift": {"policy": "Report", "intervalSeconds": 30}})
    memo = kopf.Memo()
    now = [1000.0]
    monkeypatch.setattr("llmpool.operator.handlers.time.monotonic", lambda: now[0])
    pods = [pod_view(make_pod("a")), pod_view(make_pod("b"))]

    assert _drift_check_due(memo, pool, pods)  # first look
    now[0] += 5
    assert not _drift_check_due(memo, pool, pods)  # nothing changed, interval not over
    restarted = [pods[0], pod_view(make_pod("b", restart_count=1))]
    assert _drift_check_due(memo, pool, restarted)  # a pod restarted: check now
    now[0] += 10
    assert not _drift_check_due(memo, pool, restarted)
    now[0] += 30
    assert _drift_check_due(memo, pool, restarted)  # the interval is over
    unready = [restarted[0], pod_view(make_pod("b", restart_count=1, ready=False))]
    assert _drift_check_due(memo, pool, unready)


def test_replica_change():
    scaled = kopf.Diff([kopf.DiffItem(kopf.DiffOperation.CHANGE, ("spec", "replicas"), 2, 3)])
    assert replica_change(scaled) == (2, 3)
    other = kopf.Diff([kopf.DiffItem(kopf.DiffOperation.CHANGE, ("spec", "maxModelLen"), 1, 2)])
    assert replica_change(other) is None
    assert replica_change(kopf.Diff([])) is None


def test_restore_waits_for_the_index_to_see_a_fresh_apply(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("llmpool.operator.handlers.time.monotonic", lambda: now[0])
    memo = kopf.Memo()
    assert _restore_due(memo)  # never applied by this process
    memo["applied_at"] = 100.0
    assert not _restore_due(memo)
    now[0] += 10
    assert _restore_due(memo)


INDEXES = {
    name: {}
    for name in (
        "engine_pods",
        "engine_deployments",
        "child_configmaps",
        "child_secrets",
        "child_services",
        "child_disruption_budgets",
        "child_deployments",
        "child_demands",
        "gateway_demands",
        "pools_by_served_name",
    )
}


async def test_a_demand_record_wakes_its_pools_converge_with_the_pools_own_memo(monkeypatch):
    runs = []

    async def converge(**kwargs):
        runs.append((kwargs["namespace"], kwargs["name"], kwargs["uid"], kwargs["memo"]))

    monkeypatch.setattr(handlers, "converge", converge)
    shared: dict = {}
    pool_memo = kopf.Memo(pool_handles=shared)
    handlers._register(pool_memo, "team", "chat", "uid-chat")
    demand_memo = kopf.Memo(pool_handles=shared)  # another object's copy of the operator's memo
    labels = {"llmpool.dev/pool": "chat"}
    await handlers.demand_changed(namespace="team", labels=labels, memo=demand_memo, **INDEXES)
    assert runs == [("team", "chat", "uid-chat", pool_memo)]
    # A pool this operator has not seen (yet), or one deleted: nothing to wake.
    handlers.forget(name="chat", namespace="team", memo=pool_memo)
    await handlers.demand_changed(namespace="team", labels=labels, memo=demand_memo, **INDEXES)
    assert len(runs) == 1
