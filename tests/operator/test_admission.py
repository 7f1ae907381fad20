"""What pools may ask for: names in the grammar, engine images and host paths the operator's
administrator allows."""

from __future__ import annotations

import pytest

from llmpool.operator.admission import (
    HOST_PATH_NOT_ALLOWED,
    IMAGE_NOT_ALLOWED,
    INVALID_NAME,
    Policy,
    host_path_allowed,
    image_allowed,
    image_repository,
    refusal,
)
from llmpool.operator.spec import PoolSpec

CHART_IMAGE = "ghcr.io/llmpool/llmpool:0.1.0"


@pytest.mark.parametrize(
    ("image", "repository"),
    [
        ("ghcr.io/llmpool/llmpool:0.1.0", "ghcr.io/llmpool/llmpool"),
        ("ghcr.io/llmpool/llmpool@sha256:" + "a" * 64, "ghcr.io/llmpool/llmpool"),
        ("registry:5000/llmpool", "registry:5000/llmpool"),
        ("registry:5000/llmpool:dev", "registry:5000/llmpool"),
        ("llmpool:latest", "llmpool"),
        ("llmpool", "llmpool"),
    ],
)
def test_image_repository(image, repository):
    assert image_repository(image) == repository


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("ghcr.io/llmpool/llmpool:0.2.0", True),
        ("ghcr.io/llmpool/llmpool@sha256:" + "b" * 64, True),
        ("ghcr.io/llmpool/llmpool", True),
        ("ghcr.io/llmpool/llmpool-miner:1", False),
        ("ghcr.io/llmpool/llmpool/evil:1", False),
        ("evil.example/llmpool:1", False),
        ("registry.internal/team/anything:2", True),
        ("registry.internal/teamx:2", False),
    ],
)
def test_image_prefixes(image, allowed):
    prefixes = ("ghcr.io/llmpool/llmpool", "registry.internal/team/")
    assert image_allowed(image, prefixes) is allowed


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/models/llama", True),
        ("/models", True),
        ("/models/../etc/shadow", False),
        ("/modelsx/llama", False),
        ("/etc", False),
    ],
)
def test_host_path_prefixes(path, allowed):
    assert host_path_allowed(path, ("/models/",)) is allowed


def spec_with(chat_spec, **changes) -> PoolSpec:
    return PoolSpec.from_dict({**chat_spec, **changes})


FILE_MODEL = {"source": "file:///models/llama", "revision": "sha256:" + "1" * 64}


def test_the_default_policy_allows_the_operators_own_image_and_nothing_on_the_node(chat_spec):
    policy = Policy.default(CHART_IMAGE)
    assert refusal(spec_with(chat_spec), policy) is None
    assert refusal(spec_with(chat_spec, image="ghcr.io/llmpool/llmpool:0.3.0"), policy) is None
    found = refusal(spec_with(chat_spec, image="docker.io/library/python:3"), policy)
    assert found is not None and found.reason == IMAGE_NOT_ALLOWED
    assert "docker.io/library/python:3" in found.message
    assert "ghcr.io/llmpool/llmpool" in found.message
    found = refusal(spec_with(chat_spec, model=FILE_MODEL), policy)
    assert found is not None and found.reason == HOST_PATH_NOT_ALLOWED
    assert "file:///models/llama" in found.message


def test_the_operators_engine_image_is_always_allowed(chat_spec):
    policy = Policy(engine_image="llmpool:latest", allowed_images=("ghcr.io/llmpool/llmpool",))
    assert refusal(spec_with(chat_spec, image="llmpool:latest"), policy) is None


def test_host_path_models_only_under_the_allowed_prefixes(chat_spec):
    policy = Policy(
        engine_image=CHART_IMAGE,
        allowed_images=("ghcr.io/llmpool/llmpool",),
        allow_host_path_models=True,
        allowed_host_path_prefixes=("/models",),
    )
    assert refusal(spec_with(chat_spec, model=FILE_MODEL), policy) is None
    elsewhere = {"source": "file:///var/lib/kubelet/x", "revision": "sha256:" + "1" * 64}
    found = refusal(spec_with(chat_spec, model=elsewhere), policy)
    assert found is not None and found.reason == HOST_PATH_NOT_ALLOWED
    assert "/models" in found.message


def with_adapter(chat_spec, source: str) -> PoolSpec:
    adapter = {"name": "sql", "source": source, "revision": "sha256:" + "2" * 64}
    return spec_with(chat_spec, adapters=[adapter])


def test_host_path_adapters_like_host_path_models(chat_spec):
    closed = Policy.default(CHART_IMAGE)
    found = refusal(with_adapter(chat_spec, "file:///models/adapters/sql"), closed)
    assert found is not None and found.reason == HOST_PATH_NOT_ALLOWED
    assert "spec.adapters[sql].source file:///models/adapters/sql" in found.message
    # Paths in the image and volumes need no node path.
    assert refusal(with_adapter(chat_spec, "/opt/adapters/sql"), closed) is None
    assert refusal(with_adapter(chat_spec, "pvc://adapters/sql"), closed) is None

    policy = Policy(
        engine_image=CHART_IMAGE,
        allowed_images=("ghcr.io/llmpool/llmpool",),
        allow_host_path_models=True,
        allowed_host_path_prefixes=("/models",),
    )
    assert refusal(with_adapter(chat_spec, "file:///models/adapters/sql"), policy) is None
    found = refusal(with_adapter(chat_spec, "file:///srv/adapters/sql"), policy)
    assert found is not None and found.reason == HOST_PATH_NOT_ALLOWED
    assert "/models" in found.message
    # The adapter's folder is under the prefix, but its parent, the folder mounted, is not.
    found = refusal(with_adapter(chat_spec, "file:///models"), policy)
    assert found is not None and "its folder / is mounted" in found.message
    found = refusal(with_adapter(chat_spec, "file:///models/../etc/sql"), policy)
    assert found is not None and found.reason == HOST_PATH_NOT_ALLOWED


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"servedName": "team-a/chat"}, "spec.model.servedName 'team-a/chat'"),
        ({"servedName": "-chat"}, "spec.model.servedName '-chat'"),
        ({"servedName": "x" * 129}, "spec.model.servedName has 129 characters"),
        # No servedName: the source's last path segment, which must be a name too.
        ({"source": "file:///models/m@2", "servedName": None}, "last path segment of spec.model"),
    ],
)
def test_a_served_name_outside_the_grammar_is_refused(chat_spec, changes, field):
    model = {**chat_spec["model"], **changes}
    found = refusal(spec_with(chat_spec, model=model), Policy.default(CHART_IMAGE))
    assert found is not None and found.reason == INVALID_NAME
    assert field in found.message


def test_adapter_names_outside_the_grammar_or_alike_once_normalised_are_refused(chat_spec):
    def adapters(*adapter_names: str) -> PoolSpec:
        listed = [
            {"name": name, "source": f"/opt/adapters/{index}", "revision": "sha256:" + "2" * 64}
            for index, name in enumerate(adapter_names)
        ]
        return spec_with(chat_spec, adapters=listed)

    policy = Policy.default(CHART_IMAGE)
    assert refusal(adapters("sql", "qwen2.5:7b-poet"), policy) is None
    found = refusal(adapters("team-a/sql"), policy)
    assert found is not None and found.reason == INVALID_NAME
    assert "spec.adapters[team-a/sql].name 'team-a/sql' is not a valid name" in found.message
    found = refusal(adapters("sql", "SQL"), policy)
    assert found is not None and found.reason == INVALID_NAME
    assert "spec.adapters[SQL].name 'SQL' is spec.adapters[sql].name's name" in found.message
    served = chat_spec["model"].get("servedName") or "smollm2-135m-instruct"
    found = refusal(adapters(served.upper()), policy)
    assert found is not None and "is spec.model.servedName's name" in found.message
