"""Routing decisions: prefix affinity, bounded loads, drift exclusion and the choice of pool."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from llmpool.gateway import routing
from llmpool.gateway.pools import Pool, Replica
from llmpool.gateway.routing import Candidate, RoutingError

DIGEST = "sha256:" + "a" * 64
REPLICAS = [Replica(f"chat-{i}", f"http://10.0.0.{i}:8000") for i in range(4)]


def pool(
    name: str = "chat",
    *,
    priority_class: str = "interactive",
    ready: bool = True,
    drifted: frozenset[str] = frozenset(),
    pinned_digest: str | None = DIGEST,
    outgoing: dict[str, str] | None = None,
) -> Pool:
    return Pool(
        "ns", name, "smollm2", priority_class, ready, pinned_digest, drifted,
        outgoing=outgoing or {},
    )  # fmt: skip


def idle(replicas: list[Replica] = REPLICAS, digest: str | None = DIGEST) -> list[Candidate]:
    return [Candidate(r, 0.0, digest) for r in replicas]


def key(text: str) -> bytes:
    return routing.prefix_key(text)


# --- prefix keys ------------------------------------------------------------------------------


def test_the_key_depends_on_the_prefix_only() -> None:
    system = "You are the support assistant of tenant 7. " * 40  # well past the prefix window
    assert len(system) > routing.DEFAULT_PREFIX_CHARS
    first = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "a"}]}
    second = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "b"}]}
    assert key(routing.prompt_text(first)) == key(routing.prompt_text(second))
    other = {"messages": [{"role": "system", "content": "tenant 8" + system}]}
    assert key(routing.prompt_text(other)) != key(routing.prompt_text(first))


def test_prompt_text_of_completions_and_chat_parts() -> None:
    assert routing.prompt_text({"prompt": "The capital of"}) == "The capital of"
    assert routing.prompt_text({"prompt": ["first", "second"]}) == "first"
    assert routing.prompt_text({"prompt": [1, 2, 3]}) == "[1, 2, 3]"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert routing.prompt_text(parts) == "user: hi"


# --- replica choice ---------------------------------------------------------------------------


def test_affinity_is_stable_and_spreads_keys_over_replicas() -> None:
    chosen = {}
    for tenant in range(200):
        decision = routing.choose_replica(key(f"tenant {tenant}"), idle())
        assert decision.reason == routing.AFFINITY
        assert routing.choose_replica(key(f"tenant {tenant}"), idle()) == decision
        chosen[tenant] = decision.replica
    shares = Counter(r.name for r in chosen.values())
    assert set(shares) == {r.name for r in REPLICAS}
    assert min(shares.values()) > 200 / len(REPLICAS) / 2  # no replica starved


def test_a_replica_leaving_moves_only_its_own_keys() -> None:
    """Rendezvous hashing: the keys of the replicas that stay keep their replica."""
    remaining = REPLICAS[:3]
    for tenant in range(200):
        before = routing.choose_replica(key(f"tenant {tenant}"), idle()).replica
        after = routing.choose_replica(key(f"tenant {tenant}"), idle(remaining)).replica
        if before in remaining:
            assert after == before


def test_a_saturated_preferred_replica_spills_to_the_least_loaded() -> None:
    k = key("one hot tenant")
    preferred = routing.choose_replica(k, idle()).replica
    loads = {r.name: 1.0 for r in REPLICAS}
    loads[preferred.name] = 10.0
    loads["chat-3" if preferred.name != "chat-3" else "chat-2"] = 0.0
    candidates = [Candidate(r, loads[r.name], DIGEST) for r in REPLICAS]
    decision = routing.choose_replica(k, candidates)
    assert decision.reason == routing.SPILL
    assert loads[decision.replica.name] == 0.0


def test_bounded_loads_keep_one_hot_prefix_within_the_bound() -> None:
    """Every request of one prefix, none finishing: no replica exceeds ceil(1.25 * mean)."""
    k = key("the same system prompt for everyone")
    loads = dict.fromkeys(REPLICAS, 0.0)
    rng = random.Random(0)
    for sent in range(1, 101):
        candidates = [Candidate(r, load, DIGEST) for r, load in loads.items()]
        decision = routing.choose_replica(k, candidates, rng=rng)
        loads[decision.replica] += 1
        assert max(loads.values()) <= -(-1.25 * sent // len(REPLICAS)) + 1
    # The preferred replica stays the busiest (its cache is warm), filled to the bound.
    preferred = routing.choose_replica(k, idle()).replica
    assert loads[preferred] == max(loads.values()) == 32  # ceil(1.25 * 100 / 4)


def test_ties_are_broken_at_random() -> None:
    k = key("hot")
    preferred = routing.choose_replica(k, idle()).replica
    candidates = [Candidate(r, 5.0 if r == preferred else 0.0, DIGEST) for r in REPLICAS]
    picks = {
        routing.choose_replica(k, candidates, rng=random.Random(seed)).replica for seed in range(40)
    }
    assert picks == set(REPLICAS) - {preferred}


# --- drift ------------------------------------------------------------------------------------


def test_replicas_in_status_drift_get_no_traffic() -> None:
    drifted = pool(drifted=frozenset({"chat-0", "chat-2"}))
    healthy = routing.routable(drifted, idle())
    assert [c.replica.name for c in healthy] == ["chat-1", "chat-3"]


def test_a_replica_whose_fingerprint_digest_differs_gets_no_traffic() -> None:
    candidates = idle()
    candidates[1] = Candidate(REPLICAS[1], 0.0, "sha256:" + "b" * 64)
    candidates[2] = Candidate(REPLICAS[2], 0.0, None)  # not scraped yet: no evidence of drift
    healthy = routing.routable(pool(), candidates)
    assert [c.replica.name for c in healthy] == ["chat-0", "chat-2", "chat-3"]


OLD_DIGEST = "sha256:" + "0" * 64


def test_a_rollout_is_not_drift_outgoing_replicas_keep_serving() -> None:
    """The pin changed to DIGEST; chat-0 and chat-1 are outgoing replicas of the old template."""
    rolling = pool(outgoing={"chat-0": OLD_DIGEST, "chat-1": OLD_DIGEST})
    candidates = [
        Candidate(REPLICAS[0], 0.0, OLD_DIGEST),
        Candidate(REPLICAS[1], 0.0, OLD_DIGEST),
        Candidate(REPLICAS[2], 0.0, DIGEST),  # the first new replica
    ]
    healthy = routing.routable(rolling, candidates)
    assert [c.replica.name for c in healthy] == ["chat-0", "chat-1", "chat-2"]
    # Before any new replica is ready, the old ones serve the whole pool: no 503.
    assert len(routing.routable(rolling, candidates[:2])) == 2


def test_only_a_replica_that_differs_from_its_own_pin_is_drifted() -> None:
    rolling = pool(outgoing={"chat-0": OLD_DIGEST, "chat-1": OLD_DIGEST})
    candidates = [
        Candidate(REPLICAS[0], 0.0, OLD_DIGEST),
        Candidate(REPLICAS[1], 0.0, DIGEST),  # an old template running the new pin: drifted
        Candidate(REPLICAS[2], 0.0, OLD_DIGEST),  # a new template running the old pin: drifted
        Candidate(REPLICAS[3], 0.0, DIGEST),
    ]
    healthy = routing.routable(rolling, candidates)
    assert [c.replica.name for c in healthy] == ["chat-0", "chat-3"]


def test_a_pinned_change_mid_drift_keeps_the_drifted_replica_out() -> None:
    """chat-1 was in status.drift before the pin changed; it stays out while the others serve."""
    rolling = pool(
        drifted=frozenset({"chat-1"}), outgoing={"chat-0": OLD_DIGEST, "chat-1": OLD_DIGEST}
    )
    candidates = [Candidate(r, 0.0, OLD_DIGEST) for r in REPLICAS[:2]]
    healthy = routing.routable(rolling, candidates)
    assert [c.replica.name for c in healthy] == ["chat-0"]


def test_all_replicas_drifted_is_a_503_and_no_replica_is_another() -> None:
    everyone = pool(drifted=frozenset(r.name for r in REPLICAS))
    with pytest.raises(RoutingError) as drifted:
        routing.routable(everyone, idle())
    assert (drifted.value.status, drifted.value.code) == (503, routing.REPLICAS_DRIFTED)
    with pytest.raises(RoutingError) as empty:
        routing.routable(pool(), [])
    assert (empty.value.status, empty.value.code) == (503, routing.NO_READY_REPLICA)


# --- pools and priority -----------------------------------------------------------------------


def test_priority_picks_the_pool_of_its_class_and_defaults_to_interactive() -> None:
    chat, batch = pool("chat"), pool("batch", priority_class="batch")
    assert routing.choose_pool([batch, chat], None) == chat
    assert routing.choose_pool([batch, chat], "batch") == batch
    assert routing.choose_pool([batch, chat], "interactive") == chat
    # A class nobody serves: the model is still served, by the pool there is.
    assert routing.choose_pool([batch], "interactive") == batch


def test_ready_pools_come_first_within_a_class() -> None:
    rolling, ready = pool("a-rolling", ready=False), pool("b-ready")
    assert routing.choose_pool([rolling, ready], None) == ready


@pytest.mark.parametrize(
    ("body", "header", "expected"),
    [
        (None, None, None),
        ("batch", None, "batch"),
        (None, "batch", "batch"),
        ("interactive", "batch", "interactive"),  # the body wins
        (0, None, "interactive"),
        (1, None, "batch"),
        (7, None, "batch"),
        (-3, None, "interactive"),
        (None, "1", "batch"),
    ],
)
def test_requested_class(body: object, header: str | None, expected: str | None) -> None:
    assert routing.requested_class(body, header) == expected


def test_an_unknown_priority_is_a_400() -> None:
    with pytest.raises(RoutingError) as error:
        routing.requested_class("urgent", None)
    assert error.value.status == 400
    assert "interactive, batch" in str(error.value)


# --- adapters ---------------------------------------------------------------------------------

REVISION = "sha256:" + "5" * 64
OTHER_REVISION = "sha256:" + "6" * 64


def with_adapters(
    base: Pool, adapter_drift: frozenset[tuple[str, str]] = frozenset(), **adapters: str
) -> Pool:
    return dataclasses.replace(base, adapters=adapters, adapter_drift=adapter_drift)


def test_an_adapter_resolves_after_served_names_bare_or_qualified() -> None:
    chat = with_adapters(pool("chat"), sql=REVISION)
    batch = with_adapters(pool("batch", priority_class="batch"), sql=REVISION)
    assert routing.resolve([chat, batch], "smollm2") == ([chat, batch], None)
    assert routing.resolve([chat, batch], "sql") == ([chat, batch], "sql")
    assert routing.resolve([chat, batch], "ns/sql") == ([chat, batch], "sql")  # sent bare
    # A served name wins over an adapter of the same name in another pool.
    named_sql = dataclasses.replace(pool("other"), served_name="sql")
    assert routing.resolve([chat, named_sql], "sql") == ([named_sql], None)
    with pytest.raises(RoutingError) as missing:
        routing.resolve([chat], "poet")
    assert (missing.value.status, missing.value.code) == (404, routing.MODEL_NOT_FOUND)
    assert "smollm2, sql" in str(missing.value)


def test_an_adapter_in_two_namespaces_is_ambiguous_unless_qualified() -> None:
    ours = with_adapters(pool("chat"), sql=REVISION)
    theirs = dataclasses.replace(ours, namespace="other")
    with pytest.raises(RoutingError) as ambiguous:
        routing.resolve([ours, theirs], "sql")
    assert (ambiguous.value.status, ambiguous.value.code) == (400, routing.MODEL_AMBIGUOUS)
    assert "ns/sql, other/sql" in str(ambiguous.value)
    assert routing.resolve([ours, theirs], "other/sql") == ([theirs], "sql")


def test_models_lists_adapters_with_their_parent() -> None:
    chat = with_adapters(pool("chat"), sql=REVISION, poet=REVISION)
    elsewhere = dataclasses.replace(
        with_adapters(pool("x"), sql=REVISION), namespace="other", served_name="llama"
    )
    hidden = dataclasses.replace(with_adapters(pool("y"), lone=REVISION), ready=False)
    assert routing.adapter_ids([chat]) == {"poet": "smollm2", "sql": "smollm2"}
    assert routing.adapter_ids([chat, elsewhere, hidden]) == {
        "poet": "smollm2",
        "ns/sql": "smollm2",
        "other/sql": "llama",
    }
    assert routing.model_ids([chat, elsewhere, hidden]) == ["llama", "smollm2"]


def resident(adapters: list[dict[str, str] | None]) -> list[Candidate]:
    return [Candidate(r, 0.0, DIGEST, a) for r, a in zip(REPLICAS, adapters, strict=False)]


def test_an_adapter_goes_only_where_it_is_loaded_at_the_pinned_revision() -> None:
    chat = with_adapters(pool(), sql=REVISION)
    candidates = resident(
        [{"sql": REVISION}, {"sql": OTHER_REVISION}, None, {"sql": REVISION, "poet": REVISION}]
    )
    healthy = routing.routable(chat, candidates, "sql")
    assert [c.replica.name for c in healthy] == ["chat-0", "chat-3"]
    assert len(routing.routable(chat, candidates)) == 4  # the base model: every replica


def test_an_adapter_in_drift_keeps_its_replica_for_the_rest() -> None:
    chat = with_adapters(
        pool(), adapter_drift=frozenset({("chat-0", "sql")}), sql=REVISION, poet=REVISION
    )
    both = {"sql": REVISION, "poet": REVISION}
    candidates = resident([both, both])
    assert [c.replica.name for c in routing.routable(chat, candidates, "sql")] == ["chat-1"]
    assert len(routing.routable(chat, candidates, "poet")) == 2
    assert len(routing.routable(chat, candidates)) == 2


def test_no_replica_with_the_adapter_is_a_held_503() -> None:
    chat = with_adapters(pool(), sql=REVISION)
    for candidates in (resident([None, {}]), resident([{"sql": OTHER_REVISION}])):
        with pytest.raises(RoutingError) as error:
            routing.routable(chat, candidates, "sql")
        assert (error.value.status, error.value.code) == (503, routing.ADAPTER_NOT_RESIDENT)
        assert error.value.code in routing.HELD_CODES
    # An adapter gone from the pool's spec while a request waited: nowhere, however loaded.
    with pytest.raises(RoutingError):
        routing.routable(pool(), resident([{"sql": REVISION}]), "sql")


def test_the_affinity_key_of_an_adapter_includes_its_name() -> None:
    prefix = key("You are a SQL assistant. " * 10)
    assert routing.affinity_key(prefix, None) == prefix  # the base model's keys are unchanged
    sql, poet = routing.affinity_key(prefix, "sql"), routing.affinity_key(prefix, "poet")
    assert len({prefix, sql, poet}) == 3
    assert routing.affinity_key(prefix, "sql") == sql
    # One shared system prompt: different adapters spread over the replicas.
    firsts = {
        routing.rank(routing.affinity_key(prefix, f"adapter-{i}"), idle())[0].replica
        for i in range(20)
    }
    assert len(firsts) > 1
