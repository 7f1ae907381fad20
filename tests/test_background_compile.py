"""Compiling beside serving (engine/background_compile.py): the engine answers eager while the
decoder compiles, with transformers' tokens before, during and after the switch; nothing compiles
after it; a compile that fails leaves the engine serving eager and says so.

The engines run the tiny model (tests/conftest.py: the built-in model's shapes, 2 layers): what
is checked is the switch from eager to compiled, against transformers' tokens of the same
checkpoint, and inductor compiles 2 layers in a fraction of 30's time (the real model's compiled
parity is test_engine_vs_hf.py's "compiled" case)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from llmpool.engine import SamplingParams, compilation
from llmpool.engine.background_compile import _ServingFirst
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.server.fingerprint import live_fields

# A 256 MiB KV pool (room for every reference prompt at once) instead of the CPU default of
# 2 GiB, which kept the pytest process's memory high enough for CI's run to meet the OOM killer.
SETTINGS = {
    "dtype": "float32",
    "max_model_len": 2048,
    "kv_cache_memory": "256MiB",
    "compile": True,
    "compile_cache_dir": "",
}


def generate(
    core: EngineCore, prompts: list[list[int]], new_tokens: int, on_step: Any = None
) -> list[list[int]]:
    """Greedy tokens of ``prompts`` run together through ``core``'s step loop; ``on_step`` is
    called after each step."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    tokens: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        core.add_request(str(index), prompt, params)
        tokens[str(index)] = []
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
        if on_step is not None:
            on_step()
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return [tokens[str(index)] for index in range(len(prompts))]


def compile_state(core: EngineCore) -> str:
    """What ``/fingerprint`` says of the compile (the route answers ``live_fields``)."""
    return live_fields({"observed": {}}, core)["observed"]["compile"]["state"]


@pytest.mark.slow
def test_the_engine_serves_eager_while_compiling_then_switches_with_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch,
    tiny_folder: Path,
    tiny_greedy_reference: dict[tuple[int, ...], list[int]],
    reference_new_tokens: int,
) -> None:
    """The compile is held until the first step has run, so that the steps provably begin
    eager, and then runs while the rest of the requests step."""
    release = threading.Event()
    compile_all_sizes = compilation.compile_all_sizes

    def held(*args: Any) -> Any:
        release.wait()
        return compile_all_sizes(*args)

    monkeypatch.setattr(compilation, "compile_all_sizes", held)
    core = EngineCore(EngineConfig(**SETTINGS, model=str(tiny_folder), max_num_batched_tokens=256))
    eager = core.model.decoder
    prompts = [list(ids) for ids in tiny_greedy_reference]
    expected = [tiny_greedy_reference[tuple(prompt)] for prompt in prompts]
    states: list[str] = []

    def on_step() -> None:
        states.append(compile_state(core))
        release.set()

    assert generate(core, prompts, reference_new_tokens, on_step) == expected
    assert states[:2] == ["compiling", "compiling"], states
    core.wait_for_compile(timeout=1800)
    report = core.compile_report.as_dict()
    assert (report["state"], report["cache"], report["error"]) == ("compiled", "off", None)
    assert core.model.decoder != eager
    graphs = compilation.num_compiled_graphs()
    assert generate(core, prompts, reference_new_tokens) == expected
    assert compilation.num_compiled_graphs() == graphs, "every size was compiled beforehand"


@pytest.mark.slow
def test_a_failed_compile_is_reported_and_leaves_the_engine_serving_eager(
    monkeypatch: pytest.MonkeyPatch,
    tiny_folder: Path,
    tiny_greedy_reference: dict[tuple[int, ...], list[int]],
    reference_new_tokens: int,
) -> None:
    def fail(*args: Any) -> Any:
        raise RuntimeError("inductor could not build a kernel")

    monkeypatch.setattr(compilation, "compile_all_sizes", fail)
    core = EngineCore(EngineConfig(**SETTINGS, model=str(tiny_folder)))
    eager = core.model.decoder
    with pytest.raises(RuntimeError, match="could not build a kernel"):
        core.wait_for_compile(timeout=60)
    assert compile_state(core) == "failed"
    assert "could not build a kernel" in core.compile_report.as_dict()["error"]
    assert core.model.decoder == eager
    prompts = sorted(map(list, tiny_greedy_reference), key=len)[:3]
    expected = [tiny_greedy_reference[tuple(prompt)] for prompt in prompts]
    assert generate(core, prompts, reference_new_tokens) == expected


def test_an_eager_engine_reports_the_compile_off(tiny_folder: Path) -> None:
    core = EngineCore(
        EngineConfig(model=str(tiny_folder), dtype="float32", max_model_len=128, num_kv_blocks=8)
    )
    core.wait_for_compile()
    assert core.compile_report.as_dict()["enabled"] is False
    assert compile_state(core) == "off"


def test_the_compile_thread_is_parked_while_a_step_runs_and_resumes_after() -> None:
    gate = _ServingFirst()
    calls = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal calls
        calls += 1

    def compile_like() -> None:
        sys.setprofile(gate.profile)
        while not stop.is_set():
            count()

    thread = threading.Thread(target=compile_like, daemon=True)
    thread.start()
    try:
        with gate.step():
            time.sleep(0.05)
            parked_at = calls
            time.sleep(0.2)
            assert calls == parked_at, "the compile thread ran during the step"
        time.sleep(0.2)
        assert calls > parked_at, "the compile thread did not resume after the step"
    finally:
        stop.set()
        thread.join(timeout=10)
