"""Model names at the gateway: ``namespace/name`` is resolved in that namespace first, and names
are compared in their normal form, so that no pool takes traffic named for another namespace's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from llmpool.gateway import routing
from llmpool.gateway.pools import Pool, pool_from_object
from llmpool.gateway.routing import RoutingError
from llmpool.operator import admission
from llmpool.operator.spec import PoolSpec

CRD = Path(__file__).resolve().parents[2] / "crds" / "llmpool.yaml"
DIGEST = "sha256:" + "a" * 64
REVISION = "sha256:" + "5" * 64


def pool(namespace: str, served_name: str, name: str = "chat", **adapters: str) -> Pool:
    return Pool(
        namespace, name, served_name, "interactive", True, DIGEST, frozenset(), adapters=adapters
    )


def llmpool_object(namespace: str, served_name: str) -> dict[str, object]:
    return {
        "metadata": {"namespace": namespace, "name": "capture"},
        "spec": {
            "model": {
                "source": "builtin://smollm2-135m-instruct",
                "revision": DIGEST,
                "servedName": served_name,
            }
        },
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }


def served_name_schema() -> dict[str, object]:
    root = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema: dict[str, object] = root["properties"]["spec"]["properties"]["model"]["properties"][
        "servedName"
    ]
    return schema


def test_a_pool_named_after_another_namespaces_model_is_refused() -> None:
    """The attack: team-b names its pool `team-a/chat` to take the traffic of team-a's `chat`."""
    schema = served_name_schema()
    assert re.search(str(schema["pattern"]), "team-a/chat") is None  # the API server refuses it
    capture = llmpool_object("team-b", "team-a/chat")
    found = admission.refusal(
        PoolSpec.from_dict(capture["spec"]),  # type: ignore[arg-type]
        admission.Policy.default("llmpool:latest"),
    )
    assert found is not None and found.reason == admission.INVALID_NAME
    assert "spec.model.servedName 'team-a/chat'" in found.message


def test_a_stored_pool_with_a_slash_in_its_name_never_takes_another_namespaces_traffic() -> None:
    """Stored before the CRD refused it, team-b's `team-a/chat` pool still gets nothing."""
    victim = pool("team-a", "chat")
    capture = pool_from_object(llmpool_object("team-b", "team-a/chat"))
    assert routing.resolve([victim, capture], "team-a/chat") == ([victim], None)
    assert routing.resolve([capture, victim], "team-a/chat") == ([victim], None)
    for model in ("team-a/chat", "team-b/team-a/chat", "chat"):
        with pytest.raises(RoutingError) as missing:
            routing.resolve([capture], model)
        assert (missing.value.status, missing.value.code) == (404, routing.MODEL_NOT_FOUND)
    assert routing.model_ids([victim, capture]) == ["chat"]


def test_a_qualified_name_never_matches_another_namespaces_pool() -> None:
    """`team-a/chat` with no such pool in team-a is a 404, whoever else serves `chat`."""
    theirs = pool("team-b", "chat")
    with pytest.raises(RoutingError) as missing:
        routing.resolve([theirs], "team-a/chat")
    assert missing.value.code == routing.MODEL_NOT_FOUND
    # Nor an adapter of another namespace.
    with_sql = pool("team-b", "llama", sql=REVISION)
    with pytest.raises(RoutingError):
        routing.resolve([with_sql], "team-a/sql")
    assert routing.resolve([with_sql], "team-b/sql") == ([with_sql], "sql")


@pytest.mark.parametrize(
    "model",
    [
        "team-a/chat",
        "Team-A/Chat",
        "TEAM-A/CHAT",
        "ｔｅａｍ-ａ／ｃｈａｔ",  # fullwidth, solidus included
        "team-a／chat",  # a fullwidth solidus qualifies as "/" does
    ],
)
def test_spellings_of_a_qualified_name_resolve_in_its_namespace(model: str) -> None:
    ours, theirs = pool("team-a", "chat"), pool("team-b", "chat")
    assert routing.resolve([theirs, ours], model) == ([ours], None)


@pytest.mark.parametrize("model", ["chat", "Chat", "CHAT", "ｃｈａｔ", "ＣＨＡＴ"])
def test_spellings_of_a_bare_name_in_two_namespaces_are_all_ambiguous(model: str) -> None:
    """`Chat` in team-a and `chat` in team-b are one name: no spelling picks a namespace."""
    ours, theirs = pool("team-a", "Chat"), pool("team-b", "chat")
    with pytest.raises(RoutingError) as ambiguous:
        routing.resolve([ours, theirs], model)
    assert (ambiguous.value.status, ambiguous.value.code) == (400, routing.MODEL_AMBIGUOUS)
    assert f"team-a/{model}, team-b/{model}" in str(ambiguous.value)
    assert routing.model_ids([ours, theirs]) == ["team-a/Chat", "team-b/chat"]


def test_a_bare_name_resolves_in_any_spelling_to_its_one_pool() -> None:
    kelvin = pool("team-a", "k8s-bot")
    assert routing.resolve([kelvin], "\u212a8S-BOT") == ([kelvin], None)  # KELVIN SIGN
    assert routing.resolve([kelvin], "ｋ８ｓ-ｂｏｔ") == ([kelvin], None)


def test_an_adapter_resolves_in_any_spelling_and_is_sent_as_the_spec_spells_it() -> None:
    chat = pool("team-a", "llama", SQL=REVISION)
    assert routing.resolve([chat], "sql") == ([chat], "SQL")
    assert routing.resolve([chat], "Team-A/ｓｑｌ") == ([chat], "SQL")
    # An adapter named like another pool's served model, in another case: the served model.
    other = pool("team-a", "sql", name="other")
    assert routing.resolve([chat, other], "Sql") == ([other], None)
    assert routing.adapter_ids([chat, other]) == {}


def test_a_model_too_long_to_be_a_name_is_not_found_without_being_normalised() -> None:
    with pytest.raises(RoutingError) as missing:
        routing.resolve([pool("team-a", "chat")], "ﬁ" * 100_000)
    assert missing.value.code == routing.MODEL_NOT_FOUND


def test_two_spellings_in_one_namespace_are_one_model() -> None:
    interactive = pool("team-a", "Llama-3.2-1B-Instruct")
    batch = dataclasses.replace(
        pool("team-a", "llama-3.2-1b-instruct", name="batch"), priority_class="batch"
    )
    assert routing.resolve([interactive, batch], "LLAMA-3.2-1B-INSTRUCT")[0] == [interactive, batch]
    assert routing.model_ids([interactive, batch]) == ["Llama-3.2-1B-Instruct"]
