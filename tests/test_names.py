"""llmpool.names: the grammar of served and adapter names, and the form names are compared in."""

from __future__ import annotations

import pytest

from llmpool import names

VALID = [
    "smollm2",
    "smollm2-135m-instruct",
    "SmolLM2-135M-Instruct",
    "llama-3.2-1b-instruct",
    "Meta-Llama-3.1-8B-Instruct",
    "qwen2.5:7b",
    "mistral-7b-instruct-v0.3.Q4_K_M",
    "sql-v2.1_a",
    "0123456789abcdef0123456789abcdef01234567",  # an hf:// snapshot folder's name
    "a",
    "a" * names.NAME_MAX_LENGTH,
]
INVALID = [
    "",
    "team-a/chat",  # a name never reads as another namespace's
    "a" * (names.NAME_MAX_LENGTH + 1),
    "-chat",
    ".chat",
    ":chat",
    "chat\n",  # `$` alone would let a trailing newline through
    "my model",
    "chat\x00",
    "ｃｈａｔ",  # fullwidth: compared as "chat", never a name of its own
    "chat／x",  # fullwidth solidus
    "caf\u00e9",
]


@pytest.mark.parametrize("name", VALID)
def test_names_people_serve_are_valid(name: str) -> None:
    assert names.name_error(name, "servedName") is None
    assert names.check_name(name, "servedName") == name


@pytest.mark.parametrize("name", INVALID)
def test_invalid_names_are_refused_naming_the_field(name: str) -> None:
    error = names.name_error(name, "spec.model.servedName")
    assert error is not None and error.startswith("spec.model.servedName")
    with pytest.raises(ValueError, match="spec.model.servedName"):
        names.check_name(name, "spec.model.servedName")


def test_a_name_that_is_not_a_string_is_refused() -> None:
    assert names.name_error(5, "lora_name") == "lora_name must be a string, got int"
    assert not names.is_valid_name(None)


@pytest.mark.parametrize(
    ("spelling", "normal"),
    [
        ("Chat", "chat"),
        ("CHAT", "chat"),
        ("ｃｈａｔ", "chat"),  # fullwidth
        ("\u212a8s-bot", "k8s-bot"),  # KELVIN SIGN
        ("stra\u00dfe", "strasse"),  # casefold, not lower
        ("\ufb01ne-tune", "fine-tune"),  # the fi ligature
        ("qwen2.5:7b", "qwen2.5:7b"),
    ],
)
def test_normal_form(spelling: str, normal: str) -> None:
    assert names.normalize(spelling) == normal
    assert names.normalize(normal) == normal


def test_a_requested_model_is_normalised_then_split_at_the_first_slash() -> None:
    assert names.split_qualified("Chat") == (None, "chat")
    assert names.split_qualified("Team-A/Chat") == ("team-a", "chat")
    assert names.split_qualified("ｔｅａｍ-ａ／ｃｈａｔ") == ("team-a", "chat")
    assert names.split_qualified("team-a/team-b/chat") is None  # no name holds a "/"
    assert names.split_qualified("x" * 10_000) is None
