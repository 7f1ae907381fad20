"""`llmpool serve` start-up: flags and environment, optional engine settings, revision pin, templates."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from llmpool.engine import model_source
from llmpool.engine.config import EngineConfig
from llmpool.engine.server.cli import (
    EXIT_BAD_ARGUMENTS,
    LoraModule,
    build_parser,
    engine_config,
    lora_modules,
    main,
)
from llmpool.engine.server.prompts import PromptBuilder
from llmpool.protocol.errors import APIError

# A template unlike the model's own, so that using it shows in the prompt token count.
CUSTOM_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_every_flag_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMPOOL_MODEL", "/models/x")
    monkeypatch.setenv("LLMPOOL_MAX_MODEL_LEN", "1024")
    monkeypatch.setenv("LLMPOOL_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("LLMPOOL_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("LLMPOOL_API_KEY", "secret")
    monkeypatch.setenv("LLMPOOL_TOOL_CALL_PARSER", "mistral")
    args = build_parser().parse_args([])
    assert args.model == "/models/x"
    assert args.max_model_len == 1024
    assert args.gpu_memory_utilization == 0.5
    assert args.enable_prefix_caching is False
    assert args.api_key == "secret"
    assert args.tool_call_parser == "mistral"
    # A flag on the command line wins over the environment.
    assert build_parser().parse_args(["--max-model-len", "2048"]).max_model_len == 2048


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--quantization", "int8"], "quantization"),
        (["--quantization", "int4"], "quantization"),
        (["--kv-cache-dtype", "fp8"], "kv_cache_dtype"),
        (["--priority-class", "batch"], "priority_class"),
        (["--max-request-priority", "interactive"], "max_request_priority"),
        (["--no-enable-prefix-caching"], "enable_prefix_caching"),
    ],
)
def test_optional_engine_settings_pass_through_or_refuse(flags: list[str], name: str) -> None:
    args = build_parser().parse_args(flags)
    if name in {f.name for f in dataclasses.fields(EngineConfig)}:
        assert getattr(engine_config(args), name) == getattr(args, name)
    else:
        with pytest.raises(ValueError, match=flags[0]):
            engine_config(args)
    assert engine_config(build_parser().parse_args([])).block_size == 16  # defaults always work


def test_revision_mismatch_exits_3_with_one_clear_line(serve_process, tmp_path: Path) -> None:
    termination_log = tmp_path / "termination-log"
    termination_log.touch()
    log_path = tmp_path / "server.log"
    wrong = "sha256:" + "0" * 64
    with pytest.raises(RuntimeError, match="exited with 3"):
        serve_process(
            ["--revision", wrong], log_path, {"LLMPOOL_TERMINATION_LOG": str(termination_log)}
        )
    lines = [line for line in log_path.read_text().splitlines() if "RevisionMismatch" in line]
    assert len(lines) == 1 and "ERROR" in lines[0] and wrong in lines[0]
    assert termination_log.read_text().startswith("RevisionMismatch:")


@pytest.fixture(scope="module")
def folder_without_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model's files, linked, minus its chat template."""
    source = model_source.resolve(None).folder
    folder = tmp_path_factory.mktemp("no-template")
    for path in source.iterdir():
        if path.name != "chat_template.jinja":
            (folder / path.name).symlink_to(path)
    return folder


def test_a_model_without_template_refuses_chat_with_a_400(folder_without_template: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folder_without_template)
    with pytest.raises(APIError, match="--chat-template") as raised:
        PromptBuilder(tokenizer, None, 2048).chat_ids([{"role": "user", "content": "hi"}], True)
    assert raised.value.status == 400


def test_chat_template_file_is_used_and_pinned(
    serve_process, folder_without_template: Path, tmp_path: Path
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    server = serve_process(
        [str(folder_without_template), "--chat-template", str(template), "--served-model-name", "smol",
         "--max-model-len", "256", "--kv-cache-memory", "32MiB", "--no-access-log"],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
        )
        tokenizer = AutoTokenizer.from_pretrained(folder_without_template)
        rendered = "[user] hi\n[assistant] "
        assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        pinned = httpx.get(f"{server.url}/fingerprint", timeout=60).json()["pinned"]
        assert pinned["chatTemplateSha256"] == hashlib.sha256(CUSTOM_TEMPLATE.encode()).hexdigest()
        assert pinned["servedName"] == "smol" and pinned["source"] == str(folder_without_template)
    finally:
        assert server.terminate() == 0


@pytest.mark.parametrize(
    "flags",
    [
        ["--quantization", "fp8"],
        ["--kv-cache-dtype", "int4"],
        ["--max-request-priority", "vip"],
        ["--tool-call-parser", "pythonic"],
    ],
)
def test_options_the_engine_cannot_run_are_refused_by_the_parser(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(flags)
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_the_gemm_probe_patience_reaches_the_engine_config_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert engine_config(build_parser().parse_args([])).gemm_probe_patience_s is None
    args = build_parser().parse_args(["--gemm-probe-patience", "0"])
    assert engine_config(args).gemm_probe_patience_s == 0.0
    monkeypatch.setenv("LLMPOOL_GEMM_PROBE_PATIENCE", "2.5")
    assert engine_config(build_parser().parse_args([])).gemm_probe_patience_s == 2.5
    with pytest.raises(ValueError, match="gemm_probe_patience_s must be 0 or more"):
        engine_config(build_parser().parse_args(["--gemm-probe-patience", "-1"]))


def test_lora_flags_reach_the_engine_config_and_modules_parse_as_vllm_writes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pinned = '{"name": "b", "path": "/a/b", "revision": "sha256:ab", "base_model_name": "x"}'
    args = build_parser().parse_args(
        ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32",
         "--lora-modules", "a=/a/a", pinned]
    )  # fmt: skip
    config = engine_config(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 4, 32)
    assert lora_modules(args) == [LoraModule("a", "/a/a"), LoraModule("b", "/a/b", "sha256:ab")]
    monkeypatch.setenv("LLMPOOL_ENABLE_LORA", "true")
    monkeypatch.setenv("LLMPOOL_LORA_MODULES", "a=/a/a c=/a/c")
    from_env = build_parser().parse_args([])
    assert lora_modules(from_env) == [LoraModule("a", "/a/a"), LoraModule("c", "/a/c")]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--lora-modules", "a=/a"], "needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "name=path"),
        (["--enable-lora", "--lora-modules", "=/a"], "name=path"),
        (["--enable-lora", "--lora-modules", "a/b=/a"], "not a valid name"),
        (["--enable-lora", "--lora-modules", "a=/a", "A=/b"], "twice"),
        (["--enable-lora", "--lora-modules", "a=/a", "a=/b"], "twice"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "a name and a path"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/a", "rank": 4}'], "keys"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "path": '], "not JSON"),
    ],
)
def test_bad_lora_modules_are_refused(flags: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        lora_modules(build_parser().parse_args(flags))


@pytest.mark.parametrize("name", ["team-a/chat", "-chat", "my model", "x" * 129])
def test_a_served_model_name_outside_the_grammar_is_refused(name: str) -> None:
    flag = f"--served-model-name={name}"
    with pytest.raises(ValueError, match="--served-model-name"):
        engine_config(build_parser().parse_args([flag]))
    assert main([flag]) == EXIT_BAD_ARGUMENTS  # before loading anything


def test_a_served_model_name_in_the_grammar_reaches_the_config() -> None:
    config = engine_config(build_parser().parse_args(["--served-model-name", "qwen2.5:7b"]))
    assert config.served_model_name == "qwen2.5:7b"
