"""llmpool.pinning: the engine and the operator must build the same pinned dict and digest."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmpool import pinning
from llmpool.operator.engine_args import CHAT_TEMPLATE_PATH, engine_args, quantity_bytes
from llmpool.operator.spec import PoolSpec


def vllm_style_parser() -> argparse.ArgumentParser:
    """The pinned flags as vLLM spells them (what `llmpool serve` mirrors)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--revision")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--chat-template")
    return parser


def engine_side_pinned(spec: dict, chat_template: str | None) -> dict:
    """What an engine started with the operator's arguments reports at /fingerprint."""
    args, _ = vllm_style_parser().parse_known_args(engine_args(PoolSpec.from_dict(spec)))
    if args.chat_template is not None:
        assert args.chat_template == CHAT_TEMPLATE_PATH
    template = chat_template if args.chat_template is not None else None
    return pinning.pinned_from_engine_args(args, template)


def test_spec_and_engine_agree(chat_spec, chat_template):
    operator_side = pinning.pinned_from_spec(chat_spec, chat_template)
    assert engine_side_pinned(chat_spec, chat_template) == operator_side
    assert operator_side["chatTemplateSha256"] == hashlib.sha256(chat_template.encode()).hexdigest()


def test_spec_and_engine_agree_without_template(batch_spec):
    operator_side = pinning.pinned_from_spec(batch_spec, None)
    assert operator_side["chatTemplateSha256"] is None
    assert engine_side_pinned(batch_spec, None) == operator_side


@pytest.mark.parametrize(
    "change",
    [
        {"quantization": "int8"},
        {"quantization": "int8", "kvCacheDtype": "fp8"},
        {"maxModelLen": 1024},
        {"engine": {"blockSize": 32}},
        {"model": {"source": "pvc://models/llama", "revision": "sha256:" + "1" * 64}},
        {"model": {"source": "hf://org/name", "revision": "a" * 40, "servedName": "x"}},
        {"model": {"source": "file:///models/x", "revision": "sha256:" + "2" * 64}},
    ],
)
def test_agreement_holds_for_every_pinned_setting(chat_spec, chat_template, change):
    spec = {**chat_spec, **change}
    assert engine_side_pinned(spec, chat_template) == pinning.pinned_from_spec(spec, chat_template)


def test_digest_is_sha256_of_canonical_json():
    pinned = {"b": 1, "a": "é"}
    expected = hashlib.sha256('{"a":"é","b":1}'.encode()).hexdigest()
    assert pinning.pinned_digest(pinned) == "sha256:" + expected


@given(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=6))
def test_digest_ignores_key_order(pinned):
    reordered = dict(reversed(list(pinned.items())))
    assert pinning.pinned_digest(pinned) == pinning.pinned_digest(reordered)
    assert json.loads(pinning.canonical_json(pinned)) == pinned


def test_pinned_dict_has_exactly_the_pinned_keys(chat_spec, chat_template):
    assert tuple(pinning.pinned_from_spec(chat_spec, chat_template)) == pinning.PINNED_KEYS


@pytest.mark.parametrize(
    "change",
    [
        {"quantization": "int8"},
        {"kvCacheDtype": "fp8"},
        {"maxModelLen": 1024},
        {"engine": {"blockSize": 32}},
        {"model": {"source": "builtin://smollm2-135m-instruct", "revision": "sha256:" + "0" * 64}},
        {
            "model": {
                "source": "builtin://smollm2-135m-instruct",
                "revision": "sha256:" + "b" * 64,
                "servedName": "other",
            }
        },
    ],
)
def test_every_pinned_field_changes_the_digest(chat_spec, chat_template, change):
    before = pinning.pinned_digest(pinning.pinned_from_spec(chat_spec, chat_template))
    after = pinning.pinned_digest(pinning.pinned_from_spec({**chat_spec, **change}, chat_template))
    assert before != after


def test_template_bytes_change_the_digest(chat_spec, chat_template):
    before = pinning.pinned_digest(pinning.pinned_from_spec(chat_spec, chat_template))
    after = pinning.pinned_digest(pinning.pinned_from_spec(chat_spec, chat_template + " "))
    assert before != after


def test_non_pinned_settings_keep_the_digest(chat_spec, chat_template):
    before = pinning.pinned_digest(pinning.pinned_from_spec(chat_spec, chat_template))
    changed = {
        **chat_spec,
        "replicas": 7,
        "engine": {**chat_spec["engine"], "maxNumSeqs": 3, "gpuMemoryUtilization": 0.5},
        "priorityClass": "batch",
        "drift": {"policy": "Report", "intervalSeconds": 5},
    }
    assert pinning.pinned_digest(pinning.pinned_from_spec(changed, chat_template)) == before


def test_engine_defaults_fill_unset_settings():
    args = argparse.Namespace(
        model="builtin://smollm2-135m-instruct",
        revision="sha256:" + "a" * 64,
        served_model_name=None,
        max_model_len=None,
        block_size=16,
    )
    pinned = pinning.pinned_from_engine_args(args, None, max_model_len=8192)
    assert pinned == {
        "source": "builtin://smollm2-135m-instruct",
        "revision": "sha256:" + "a" * 64,
        "servedName": "smollm2-135m-instruct",
        "chatTemplateSha256": None,
        "quantization": "none",
        "kvCacheDtype": "auto",
        "maxModelLen": 8192,
        "blockSize": 16,
    }


@pytest.mark.parametrize(
    ("source", "revision", "argument"),
    [
        ("builtin://smollm2-135m-instruct", "sha256:x", "builtin://smollm2-135m-instruct"),
        ("file:///models/x", "sha256:x", "file:///models/x"),
        ("pvc://claim/llama/3b", "sha256:x", "/models/pvc/claim/llama/3b"),
        ("hf://org/name", "c" * 40, f"/models/hf/hub/models--org--name/snapshots/{'c' * 40}"),
    ],
)
def test_engine_model_argument(source, revision, argument):
    assert pinning.engine_model_argument(source, revision) == argument


def test_chat_template_sha_of_str_and_bytes_agree():
    text = "{{ messages }}\n✓"
    assert pinning.chat_template_sha256(text) == pinning.chat_template_sha256(text.encode())
    assert pinning.chat_template_sha256(None) is None


def test_the_real_engine_parser_agrees(chat_spec, chat_template, repo_root):
    """Once `llmpool serve` exposes its parser, the agreement is checked against it too."""
    if not (repo_root / "engine" / "server" / "cli.py").exists():
        pytest.skip("llmpool.engine.server.cli is not there yet")
    cli = importlib.import_module("llmpool.engine.server.cli")
    if not hasattr(cli, "build_parser"):
        pytest.skip("llmpool.engine.server.cli has no build_parser()")
    args = cli.build_parser().parse_args(engine_args(PoolSpec.from_dict(chat_spec)))
    engine_side = pinning.pinned_from_engine_args(args, chat_template)
    assert engine_side == pinning.pinned_from_spec(chat_spec, chat_template)


def test_pinning_is_stdlib_only():
    """The engine imports this module; it must not pull in kubernetes, kopf or yaml."""
    import ast
    import sys

    tree = ast.parse(Path(pinning.__file__).read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module.split(".")[0])
    assert modules <= set(sys.stdlib_module_names) | {"__future__"}


def test_the_engine_accepts_the_examples_arguments(chat_spec, batch_spec, repo_root):
    """`llmpool serve` must start from what the operator renders for both example pools."""
    if not (repo_root / "engine" / "server" / "cli.py").exists():
        pytest.skip("llmpool.engine.server.cli is not there yet")
    cli = importlib.import_module("llmpool.engine.server.cli")
    for spec in (chat_spec, batch_spec):
        args = cli.build_parser().parse_args(engine_args(PoolSpec.from_dict(spec)))
        config = cli.engine_config(args)
        assert config.max_model_len == spec["maxModelLen"]
        assert config.max_request_priority == spec["priorityClass"]
        assert config.kv_cache_memory == quantity_bytes(spec["engine"]["kvCacheMemory"])
