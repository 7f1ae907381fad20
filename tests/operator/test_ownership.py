"""The operator applies a child only over nothing or over an object the pool controls."""

from __future__ import annotations

from llmpool.operator.ownership import Conflict, conflict, conflict_message, controlled_by

UID = "uid-pool"


def owner(uid: str, *, controller: bool = True, kind: str = "LLMPool", name: str = "chat") -> dict:
    return {"apiVersion": "llmpool.dev/v1alpha1", "kind": kind, "name": name, "uid": uid,
            "controller": controller}  # fmt: skip


def test_nothing_there_or_the_pools_own_object_is_no_conflict():
    assert conflict("Service", None, UID) is None
    assert conflict("Service", {"name": "chat", "ownerReferences": [owner(UID)]}, UID) is None
    assert controlled_by({"ownerReferences": [owner("x", controller=False), owner(UID)]}, UID)


def test_an_object_the_pool_does_not_control_is_a_conflict():
    assert conflict("Service", {"name": "chat"}, UID) == Conflict("Service", "chat", "")
    # Owned, but not as controller: still not the pool's.
    loose = {"name": "chat", "ownerReferences": [owner(UID, controller=False)]}
    assert conflict("Service", loose, UID) == Conflict("Service", "chat", "")
    other = {"name": "chat", "ownerReferences": [owner("uid-old")]}
    found = conflict("ConfigMap", other, UID)
    assert found is not None and found.controller == "LLMPool chat (uid uid-old)"
    foreign = {"name": "chat", "ownerReferences": [owner("u", kind="HelmRelease", name="web")]}
    assert "controlled by HelmRelease web" in conflict("Service", foreign, UID).describe()


def test_the_message_names_every_object_and_says_nothing_was_applied():
    message = conflict_message(
        [Conflict("Service", "chat", ""), Conflict("Secret", "chat-engine-key", "Foo bar (uid u)")]
    )
    assert "Service chat already exists and is not the pool's" in message
    assert "Secret chat-engine-key already exists and is controlled by Foo bar" in message
    assert "were not applied" in message
