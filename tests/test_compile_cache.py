"""The compiled decoder's artifact cache: its key, its entries on disk, and a second start that
compiles from it and generates what the eager engine does."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig

from llmpool.engine import LLM, SamplingParams, compile_cache, gemm_store
from llmpool.engine.compile_cache import ARTIFACTS_FILE, KEY_FILE, CompileCache
from llmpool.engine.kernels.capabilities import GemmProbe
from llmpool.engine.server.cli import build_parser, engine_config
from tests.conftest import small_config

FIELDS = {
    "model": "sha256:m",
    "dtype": "float32",
    "quantization": "none",
    "kvCacheDtype": "float32",
    "attentionBackend": "cpu",
    "blockSize": "16",
    "maxTokens": "8",
    "kernels": "k",
    "torch": "2.15.0",
    "llmpool": "0.1.0",
    "cpuFlags": "f",
    "compiler": "g++ 12",
}


def test_the_key_changes_with_each_field_and_only_with_them() -> None:
    key = compile_cache.cache_key(FIELDS)
    assert compile_cache.cache_key(dict(reversed(FIELDS.items()))) == key
    others = {
        compile_cache.cache_key({**FIELDS, name: value + "'"}) for name, value in FIELDS.items()
    }
    assert len(others) == len(FIELDS) and key not in others


def test_the_environment_fields_name_torch_the_cpu_and_the_compiler() -> None:
    fields = compile_cache.environment_fields()
    assert {"torch", "python", "llmpool", "cpuFlags", "compiler"} <= set(fields)
    assert all(isinstance(value, str) and value for value in fields.values())


def test_cache_root_default_disabled_and_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert compile_cache.cache_root(None) == Path("/x/llmpool/compile")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/u")
    assert compile_cache.cache_root(None) == Path("/home/u/.cache/llmpool/compile")
    assert compile_cache.cache_root("") is None
    assert compile_cache.cache_root("None") is None
    assert compile_cache.cache_root("/c") == Path("/c")


def test_an_entry_is_written_whole_and_an_unreadable_one_is_logged_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = CompileCache(tmp_path, FIELDS)
    assert not cache.load()  # none yet: a miss, nothing logged
    cache.save(b"not torch's artifacts")
    assert sorted(path.name for path in tmp_path.iterdir()) == [cache.key]  # no staging left
    assert json.loads((cache.entry / KEY_FILE).read_text()) == FIELDS
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        assert not cache.load()
    assert f"ignoring the compile cache entry {cache.entry / ARTIFACTS_FILE}" in caplog.text
    cache.save(b"newer")
    assert (cache.entry / ARTIFACTS_FILE).read_bytes() == b"newer"


def test_an_unwritable_root_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        CompileCache(blocker / "root", FIELDS).save(b"x")
    assert "cannot write the compile cache" in caplog.text


def test_serve_reads_the_compile_cache_dir_flag_and_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert engine_config(build_parser().parse_args([])).compile_cache_dir is None
    monkeypatch.setenv("LLMPOOL_COMPILE_CACHE_DIR", "none")
    assert engine_config(build_parser().parse_args([])).compile_cache_dir == "none"
    args = build_parser().parse_args(["--compile-cache-dir", "/c"])
    assert engine_config(args).compile_cache_dir == "/c"


# One start of a compiled engine in its own process, with inductor's local caches empty, so
# that only the compile cache can spare it the compile. Prints its report and greedy tokens.
CHILD = """
import json, logging, sys
from llmpool.engine import LLM, SamplingParams
logging.basicConfig(level=logging.INFO)
llm = LLM(sys.argv[3], dtype="float32", compile=True, max_num_batched_tokens=4,
          compile_cache_dir=sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[2]), params)
probe = llm.engine.kernels.gemm_probe
print(json.dumps({"report": llm.engine.compile_report.as_dict(),
                  "gemmProbe": None if probe is None else probe.as_observed(),
                  "tokens": [out.outputs[0].token_ids for out in outputs]}))
"""
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def start_compiled(cache_dir: Path, inductor_dir: Path, model: Path) -> tuple[dict, str]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache_dir), json.dumps(PROMPTS), str(model)],
        capture_output=True, text=True, env=env, timeout=900, check=True,
    )  # fmt: skip
    return json.loads(result.stdout.splitlines()[-1]), result.stderr


@pytest.mark.slow
def test_a_second_start_compiles_from_the_cache_and_generates_what_eager_does(
    save_small_checkpoint: Callable[[Any, Path], Path], tmp_path: Path
) -> None:
    # A 2-layer random Llama: the compiled decoder unrolls every layer, and the built-in
    # model's 30 took ~6 of CI's minutes to compile cold here; the cache is the same code.
    model = save_small_checkpoint(small_config(LlamaConfig), tmp_path / "model")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eager = LLM(str(model), dtype="float32", max_num_batched_tokens=4).generate(PROMPTS, params)
    expected = [out.outputs[0].token_ids for out in eager]
    cache_dir = tmp_path / "compile"

    cold, log = start_compiled(cache_dir, tmp_path / "inductor-1", model)
    assert cold["report"]["cache"] == "miss" and cold["tokens"] == expected
    assert "cold: no cached artifacts for key" in log
    [entry] = (path for path in cache_dir.iterdir() if path.name != gemm_store.FOLDER)
    assert entry.name == cold["report"]["key"]

    warm, log = start_compiled(cache_dir, tmp_path / "inductor-2", model)
    assert warm["report"] == {**warm["report"], "cache": "hit", "key": entry.name}
    assert warm["tokens"] == expected
    assert "from cached artifacts" in log
    # Where the first start probed the float32 GEMMs undisturbed, the second ran its choice
    # (which is in the key: had it chosen otherwise, it would have missed).
    probe = cold["gemmProbe"]
    if probe is not None and GemmProbe(probe["attempts"], probe["neighbourShare"]).settled:
        assert warm["gemmProbe"] == {**probe, "stored": True}
