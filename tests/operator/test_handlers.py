"""The little logic kept in the kopf handlers: which update scaled a pool, and waking a pool's
``converge`` from another resource's handler."""

from __future__ import annotations

import kopf

from llmpool.operator import handlers, indexes, served_names
from llmpool.operator.handlers import replica_change


def test_replica_change():
    scaled = kopf.Diff([kopf.DiffItem(kopf.DiffOperation.CHANGE, ("spec", "replicas"), 2, 3)])
    assert replica_change(scaled) == (2, 3)
    other = kopf.Diff([kopf.DiffItem(kopf.DiffOperation.CHANGE, ("spec", "maxModelLen"), 1, 2)])
    assert replica_change(other) is None
    assert replica_change(kopf.Diff([])) is None


INDEXES: dict[str, dict] = {
    index_id: {}
    for index_id in (
        indexes.ENGINE_PODS,
        indexes.ENGINE_DEPLOYMENTS,
        *indexes.CHILD_INDEXES,
        indexes.GATEWAY_DEMANDS,
        indexes.POOLS_BY_SERVED_NAME,
    )
}


def test_every_index_is_registered_under_its_constant():
    registry = kopf.get_default_registry()
    registered = {handler.id for handler in registry._indexing.get_all_handlers()}
    assert set(INDEXES) <= registered


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


def test_a_pool_claims_its_served_name_in_its_normal_form(chat_spec):
    """`Chat` in team-a and `chat` in team-b are one name to the gateway: one key here, so the
    conflict check sees both claims, each qualified by its namespace."""
    spelled = {**chat_spec, "model": {**chat_spec["model"], "servedName": "SmolLM2"}}
    claims: dict[str, list[tuple[str, str]]] = {}
    for namespace, name, spec in (("team-a", "ours", chat_spec), ("team-b", "theirs", spelled)):
        for key, claim in indexes.pools_by_served_name(namespace, name, spec).items():
            claims.setdefault(key, []).append(claim)
    assert claims == {"smollm2": [("team-a", "ours"), ("team-b", "theirs")]}
    assert served_names.rivals(claims, "smollm2", "team-a") == ["team-b/theirs"]
    assert served_names.rivals(claims, "SmolLM2", "team-b") == ["team-a/ours"]
