"""The built image, run the way the chart runs pods: read-only root filesystem, tmpfs at /tmp, uid
10001. Marked ``image`` and deselected by default (it needs dockerd and a built image); run it
after ``bash scripts/build-image.sh`` with::

    .venv/bin/pytest tests/image -m image    # LLMPOOL_IMAGE picks another tag
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletion

from llmpool import pinning
from llmpool.engine import builtin_model, model_source
from llmpool.engine.llm import LLM
from llmpool.engine.outputs import RequestOutput
from llmpool.engine.sampling_params import SamplingParams
from tests.conftest import readable_by_all

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("LLMPOOL_IMAGE", "ghcr.io/llmpool/llmpool:0.1.0")
# A pod's emptyDir allows executables; docker's tmpfs is noexec unless told otherwise, and the
# engine loads the kernels it builds (inductor's, the cpu attention backend's) from /tmp.
POD_LIKE = ["--read-only", "--tmpfs", "/tmp:exec", "--user", "10001"]
START_TIMEOUT_S = 300
MESSAGES = [{"role": "user", "content": "What is PagedAttention?"}]
MAX_TOKENS = 24


def docker(*args: str) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("docker")
    if executable is None:
        pytest.fail("no docker client on PATH: run scripts/build-image.sh (it installs one)")
    return subprocess.run([executable, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def image() -> str:
    inspected = docker("image", "inspect", IMAGE)
    if inspected.returncode != 0:
        pytest.fail(f"{IMAGE} is not built: {inspected.stderr.strip()}; run scripts/build-image.sh")
    return IMAGE


@contextlib.contextmanager
def serving(*flags: str, volumes: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """``llmpool serve FLAGS`` in a pod-like container (``volumes`` mounted, as docker's
    ``--volume`` takes them), published on a free port of 127.0.0.1: yields its URL and
    container id."""
    mounts = [arg for volume in volumes for arg in ("--volume", volume)]
    started = docker(
        "run", "--detach", *POD_LIKE, *mounts, "--publish", "127.0.0.1::8000", IMAGE,
        "serve", *flags,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    container = started.stdout.strip()
    try:
        address = docker("port", container, "8000/tcp").stdout.split()[0]
        url = f"http://{address}"
        wait_until_ready(container, url)
        yield url, container
    finally:
        docker("rm", "--force", container)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving("--dtype", "float32") as (url, _):  # the chat test compares with float32
        yield url


@pytest.fixture(scope="module")
def reference_reply() -> RequestOutput:
    """The host's eager float32 engine's greedy answer to ``MESSAGES``."""
    (expected,) = LLM(device="cpu", dtype="float32").chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    return expected


def wait_until_ready(container: str, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        running = docker("inspect", "--format", "{{.State.Running}}", container).stdout.strip()
        if running != "true":
            pytest.fail(f"the container exited:\n{docker('logs', container).stderr[-4000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    pytest.fail(f"not ready after {START_TIMEOUT_S}s:\n{docker('logs', container).stderr[-4000:]}")


def example_revisions() -> set[str]:
    return {
        document["spec"]["model"]["revision"]
        for path in sorted((ROOT / "examples").glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document and document["kind"] == "LLMPool"
    }


def test_models_lists_the_built_in_model(server: str) -> None:
    models = httpx.get(f"{server}/v1/models", timeout=30).raise_for_status().json()
    served_name = pinning.default_served_name(builtin_model.BUILTIN_SOURCE)
    assert [model["id"] for model in models["data"]] == [served_name]


def test_fingerprint_pins_the_revision_the_examples_pin(server: str) -> None:
    fingerprint = httpx.get(f"{server}/fingerprint", timeout=60).raise_for_status().json()
    assert fingerprint["pinned"]["source"] == builtin_model.BUILTIN_SOURCE
    assert {fingerprint["pinned"]["revision"]} == example_revisions()
    # The baked weights are the ones this checkout's engine converts from the same GGUF file.
    # (Not the tokenizer digest: tokenizer_config.json records local_files_only, i.e. whether
    # HF_HUB_OFFLINE was set when converting; the chat test compares the tokenizers' behaviour.)
    here = model_source.resolve(None).folder
    assert fingerprint["observed"]["weightsDigest"] == model_source.weights_digest(here)


def chat(url: str) -> ChatCompletion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    return client.chat.completions.create(
        model=pinning.default_served_name(builtin_model.BUILTIN_SOURCE),
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
    )


def test_chat_completion_is_the_engines_greedy_answer(
    server: str, reference_reply: RequestOutput
) -> None:
    reply = chat(server)
    assert reply.choices[0].message.content == reference_reply.outputs[0].text
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(reference_reply.prompt_token_ids)
    assert reply.usage.completion_tokens == len(reference_reply.outputs[0].token_ids)


def compile_state(url: str) -> str:
    fingerprint = httpx.get(f"{url}/fingerprint", timeout=60).raise_for_status().json()
    return fingerprint["observed"]["compile"]["state"]


def test_compiled_engine_builds_its_kernels_in_tmp_and_answers_as_eager(tiny_folder: Path) -> None:
    """``--compile`` in the image: inductor finds its C++ compiler, writes only under /tmp (the
    root is read-only) and the float32 engine answers what the eager one does while it compiles
    in the background and once it runs compiled.

    The engine serves the tiny model (the built-in shapes, 2 layers; tests/conftest.py) from a
    read-only volume: inductor's compile of the built-in model's 30 layers took 295 s of the
    image stage, and what is checked here is the image's compiler and writable /tmp."""
    readable_by_all(tiny_folder)  # the container runs as 10001
    (expected,) = LLM(str(tiny_folder), device="cpu", dtype="float32").chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    served_name = pinning.default_served_name(builtin_model.BUILTIN_SOURCE)
    flags = (
        "/models/tiny", "--served-model-name", served_name,
        "--dtype", "float32", "--compile", "--max-num-batched-tokens", "64",
    )  # fmt: skip
    with serving(*flags, volumes=(f"{tiny_folder}:/models/tiny:ro",)) as (url, container):
        assert chat(url).choices[0].message.content == expected.outputs[0].text
        deadline = time.monotonic() + 900
        while (state := compile_state(url)) == "compiling" and time.monotonic() < deadline:
            time.sleep(5)
        assert state == "compiled", state
        assert chat(url).choices[0].message.content == expected.outputs[0].text
        logs = docker("logs", container).stderr
        assert "compiled the decoder" in logs, logs[-4000:]
        cached = docker("exec", container, "sh", "-c", "ls /tmp/torchinductor | wc -l")
        assert int(cached.stdout) > 0, cached.stderr


def test_operator_help_runs() -> None:
    result = docker("run", "--rm", *POD_LIKE, IMAGE, "operator", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: llmpool operator" in result.stdout


def test_runs_as_10001_on_a_read_only_root_with_a_writable_tmp() -> None:
    config = json.loads(docker("image", "inspect", "--format", "{{json .Config}}", IMAGE).stdout)
    assert config["User"] == "10001:10001"
    script = "id -u; touch /opt/llmpool/written || echo root-read-only; touch /tmp/x && echo tmp-ok"
    result = docker("run", "--rm", *POD_LIKE, "--entrypoint", "sh", IMAGE, "-c", script)
    assert result.stdout.split() == ["10001", "root-read-only", "tmp-ok"], result.stderr


def test_the_c_kernels_for_every_cpu_build_from_the_installed_wheel() -> None:
    """Decode attention and LoRA's kernels (built for whatever the CPU has) compile in a pod-like
    container from the sources the wheel installed, into the writable /tmp."""
    script = (
        "from llmpool.engine.kernels import cpu_decode, cpu_lora;"
        " print(cpu_decode.KERNEL.available, cpu_lora.KERNEL.available)"
    )
    python = "/opt/llmpool/venv/bin/python3"
    result = docker("run", "--rm", *POD_LIKE, "--entrypoint", python, IMAGE, "-c", script)
    assert result.stdout.split() == ["True", "True"], result.stderr[-4000:]
