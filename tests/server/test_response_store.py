"""The per-replica store of responses: each bound (count, bytes, age, per owner) drops the oldest
first, another owner's response is the same 404 as a missing one, and ids name the replica."""

from __future__ import annotations

import json

import pytest

from llmpool.engine.server.response_store import ResponseStore, StoreLimits
from llmpool.protocol.errors import APIError
from llmpool.protocol.response_ids import replica_token, token_of

CONVERSATION = [{"role": "user", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fill(store: ResponseStore, owner: str, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        response_id = store.new_id()
        assert store.put(owner, {"id": response_id, "output": []}, CONVERSATION)
        ids.append(response_id)
    return ids


def kept(store: ResponseStore, owner: str, ids: list[str]) -> list[str]:
    found = []
    for response_id in ids:
        try:
            store.get(owner, response_id)
        except APIError:
            continue
        found.append(response_id)
    return found


def test_ids_name_the_replica() -> None:
    store = ResponseStore("chat-0", StoreLimits())
    assert token_of(store.new_id()) == replica_token("chat-0") != replica_token("chat-1")
    assert token_of("resp_nothing") is None


def test_count_and_per_owner_bounds_drop_the_oldest() -> None:
    store = ResponseStore("r", StoreLimits(max_count=5, max_per_owner=3))
    a = fill(store, "a", 4)
    assert kept(store, "a", a) == a[1:]
    b = fill(store, "b", 3)
    assert len(store) == 5 and kept(store, "a", a) == a[2:] and kept(store, "b", b) == b


def test_bytes_bound_drops_the_oldest_and_refuses_one_too_large() -> None:
    one = len(json.dumps({"id": ResponseStore("r", StoreLimits()).new_id(), "output": []}))
    size = one + len(json.dumps(CONVERSATION))
    store = ResponseStore("r", StoreLimits(max_bytes=2 * size))
    ids = fill(store, "a", 3)
    assert kept(store, "a", ids) == ids[1:] and store.size_bytes == 2 * size
    assert not store.put("a", {"id": store.new_id(), "output": ["x" * 3 * size]}, CONVERSATION)


def test_age_bound_expires() -> None:
    clock = Clock()
    store = ResponseStore("r", StoreLimits(max_age_s=60), clock)
    old = fill(store, "a", 1)
    clock.now += 30
    new = fill(store, "a", 1)
    clock.now += 31
    assert kept(store, "a", old + new) == new


def test_another_owner_gets_the_same_404_as_for_a_missing_id() -> None:
    store = ResponseStore("r", StoreLimits())
    (response_id,) = fill(store, "a", 1)
    errors = []
    for owner, wanted in (("b", response_id), ("a", store.new_id())):
        with pytest.raises(APIError) as error:
            store.get(owner, wanted)
        errors.append((error.value.status, error.value.code, wanted in error.value.message))
    assert errors == [(404, "response_not_found", True)] * 2
    with pytest.raises(APIError):
        store.delete("b", response_id)
    store.delete("a", response_id)
    assert len(store) == 0 and store.size_bytes == 0
