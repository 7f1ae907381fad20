"""A compiling engine's GEMM choice, kept beside its compile cache (``engine/gemm_store.py``):
later starts and replicas sharing the volume take it instead of probing, so that they run and
compile the same GEMMs; replicas probing at once agree on the first one published."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmpool.engine import gemm_store
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_builder import gemm_store as engine_gemm_store
from llmpool.engine.engine_builder import probe_kernels as engine_probe_kernels
from llmpool.engine.gemm_store import GemmStore
from llmpool.engine.kernels import capabilities, cpu_share
from llmpool.engine.kernels.capabilities import (
    GemmDecision,
    GemmProbe,
    KernelCapabilities,
    stored_or_probed,
)
from llmpool.engine.models.linear import GemmChoice
from llmpool.engine.models.llama import LlamaShape

FIELDS = {"cpuFlags": "f", "torch": "2.15.0", "dtype": "bfloat16", "weightShape": "3072x576"}
CHOSEN = GemmDecision(
    GemmChoice(bfloat16_kernel_max_rows=64, bfloat16_kernel="bf16_gemm"),
    "the C kernel runs 64 rows 1.19x as fast",
    GemmProbe(2, 0.04),
)
OTHER = CHOSEN._replace(gemm=GemmChoice(bfloat16_kernel_max_rows=128, bfloat16_kernel="bf16_gemm"))
BF16_BUILT = KernelCapabilities(bf16_gemm=True)


def test_a_published_choice_is_read_back_as_stored(tmp_path: Path) -> None:
    store = GemmStore(tmp_path, FIELDS)
    assert store.load() is None
    assert store.publish(CHOSEN) is CHOSEN
    assert store.path.parent == tmp_path / gemm_store.FOLDER
    assert store.load() == CHOSEN._replace(probe=GemmProbe(2, 0.04, stored=True))
    assert json.loads(store.path.read_text())["key"] == FIELDS
    assert [p.name for p in store.path.parent.iterdir()] == [store.path.name]  # no staging left


def test_each_field_is_its_own_store(tmp_path: Path) -> None:
    paths = {GemmStore(tmp_path, FIELDS).path}
    for name in FIELDS:
        paths.add(GemmStore(tmp_path, {**FIELDS, name: "other"}).path)
    assert len(paths) == 1 + len(FIELDS)


def test_the_first_choice_published_stands_for_every_later_publisher(tmp_path: Path) -> None:
    first, second = GemmStore(tmp_path, FIELDS), GemmStore(tmp_path, FIELDS)
    first.publish(CHOSEN)
    taken = second.publish(OTHER)
    assert taken.gemm == CHOSEN.gemm and taken.probe.stored
    assert first.load().gemm == CHOSEN.gemm  # type: ignore[union-attr]


def test_a_volume_without_hard_links_still_keeps_the_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(source: str, target: str) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(gemm_store.os, "link", no_links)
    store = GemmStore(tmp_path, FIELDS)
    assert store.publish(CHOSEN) is CHOSEN
    assert store.load().gemm == CHOSEN.gemm  # type: ignore[union-attr]
    assert [p.name for p in store.path.parent.iterdir()] == [store.path.name]


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        json.dumps({"gemm": {"bfloat16_kernel_max_rows": 64}}),  # no probe
        json.dumps(
            {"gemm": {"rows": 64}, "says": "", "probe": {"attempts": 1, "neighbourShare": 0}}
        ),
        json.dumps(
            {
                "gemm": {"bfloat16_kernel_max_rows": "64"},
                "says": "",
                "probe": {"attempts": 1, "neighbourShare": 0},
            }
        ),  # fmt: skip
    ],
)
def test_an_unreadable_store_is_logged_ignored_and_replaced(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = GemmStore(tmp_path, FIELDS)
    store.path.parent.mkdir()
    store.path.write_text(text)
    with caplog.at_level(logging.WARNING, logger=gemm_store.__name__):
        assert store.load() is None
        assert store.publish(CHOSEN) is CHOSEN
    assert "ignoring the stored GEMM choice" in caplog.text
    assert store.load().gemm == CHOSEN.gemm  # type: ignore[union-attr]


def test_an_unwritable_root_leaves_the_choice_to_this_start_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "a-file"
    root.write_text("")
    with caplog.at_level(logging.WARNING, logger=gemm_store.__name__):
        assert GemmStore(root, FIELDS).publish(CHOSEN) is CHOSEN
    assert "cannot store the GEMM choice" in caplog.text


def probed(monkeypatch: pytest.MonkeyPatch, decision: GemmDecision) -> list[int]:
    """Make ``undisturbed`` answer ``decision``; the list counts its calls."""
    calls: list[int] = []

    def undisturbed(choose, stored_meanwhile=None, patience_s=None):  # type: ignore[no-untyped-def]
        calls.append(1)
        return (decision.gemm, decision.says), decision.probe

    monkeypatch.setattr(capabilities, "undisturbed", undisturbed)
    return calls


def test_a_stored_choice_is_taken_without_probing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = GemmStore(tmp_path, FIELDS)
    store.publish(CHOSEN)
    calls = probed(monkeypatch, OTHER)
    with caplog.at_level(logging.INFO, logger=capabilities.__name__):
        decision = stored_or_probed(pytest.fail, store, BF16_BUILT)
    assert (decision.gemm, decision.probe.stored, calls) == (CHOSEN.gemm, True, [])
    assert "at an earlier start, which stored the choice at" in caplog.text


def test_a_stored_choice_of_a_kernel_not_built_here_is_probed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GemmStore(tmp_path, FIELDS)
    store.publish(CHOSEN)
    calls = probed(monkeypatch, OTHER._replace(gemm=GemmChoice(bfloat16_kernel="avx2_gemm")))
    avx2_only = KernelCapabilities(avx2_gemm=True)
    assert stored_or_probed(pytest.fail, store, avx2_only).gemm == GemmChoice(
        bfloat16_kernel="avx2_gemm"
    )
    assert calls == [1]
    assert store.load().gemm == GemmChoice(bfloat16_kernel="avx2_gemm")  # type: ignore[union-attr]


def test_only_a_settled_probe_is_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = GemmStore(tmp_path, FIELDS)
    disturbed = CHOSEN._replace(probe=GemmProbe(9, capabilities.PROBE_NEIGHBOUR_SHARE_MAX + 0.1))
    probed(monkeypatch, disturbed)
    assert stored_or_probed(pytest.fail, store, BF16_BUILT) == disturbed
    assert store.load() is None
    probed(monkeypatch, CHOSEN)
    assert stored_or_probed(pytest.fail, store, BF16_BUILT) == CHOSEN
    assert store.load().gemm == CHOSEN.gemm  # type: ignore[union-attr]


class _LoadedBeforeTheOther(GemmStore):
    """A store whose first load finds nothing: another start publishes after it."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, FIELDS)
        self.loads = 0

    def load(self) -> GemmDecision | None:
        self.loads += 1
        return None if self.loads == 1 else super().load()


def test_a_choice_published_first_by_another_start_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two replicas load an empty store and both probe; the second to publish runs the
    first's choice."""
    GemmStore(tmp_path, FIELDS).publish(CHOSEN)
    calls = probed(monkeypatch, OTHER)
    with caplog.at_level(logging.INFO, logger=capabilities.__name__):
        decision = stored_or_probed(pytest.fail, _LoadedBeforeTheOther(tmp_path), BF16_BUILT)
    assert (decision.gemm, decision.probe.stored, calls) == (CHOSEN.gemm, True, [1])
    assert "another start stored its GEMM choice" in caplog.text


def test_a_start_whose_probes_never_settled_takes_a_choice_stored_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    GemmStore(tmp_path, FIELDS).publish(CHOSEN)
    probed(monkeypatch, OTHER._replace(probe=GemmProbe(5, 0.4)))
    decision = stored_or_probed(pytest.fail, _LoadedBeforeTheOther(tmp_path), BF16_BUILT)
    assert decision.gemm == CHOSEN.gemm and decision.probe.stored


def test_a_start_beside_busy_neighbours_stops_probing_once_another_stored_a_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Replicas starting together: this one's probes never settle (real ``undisturbed``, the
    neighbours' share pinned at 60%), and another published its choice while the first ran;
    this one takes it after one run instead of probing out its patience."""
    monkeypatch.setattr(cpu_share, "neighbour_share", lambda run: (run(), 0.6))
    monkeypatch.setattr(capabilities, "PROBE_PATIENCE_S", 600.0)
    runs: list[int] = []

    def choose() -> capabilities.Choice:
        runs.append(1)
        return OTHER.gemm, OTHER.says

    GemmStore(tmp_path, FIELDS).publish(CHOSEN)
    with caplog.at_level(logging.INFO, logger=capabilities.__name__):
        decision = stored_or_probed(choose, _LoadedBeforeTheOther(tmp_path), BF16_BUILT)
    assert (decision.gemm, decision.probe.stored, runs) == (CHOSEN.gemm, True, [1])
    assert "another start stored its choice meanwhile" in caplog.text


# SmolLM2-135M's (only the sizes of its gate and up projections matter here).
SHAPE = LlamaShape(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
    max_position_embeddings=8192, qkv_bias=False, tie_word_embeddings=True,
)  # fmt: skip


def test_only_a_compiling_engine_with_a_cache_keeps_a_store(tmp_path: Path) -> None:
    compiling = EngineConfig(compile=True, compile_cache_dir=str(tmp_path))
    store = engine_gemm_store(compiling, torch.bfloat16, (3072, 576))
    assert store is not None and store.path.is_relative_to(tmp_path / gemm_store.FOLDER)
    assert (store.fields["dtype"], store.fields["weightShape"]) == ("bfloat16", "3072x576")
    assert "cpuFlags" in store.fields and "compiler" in store.fields
    # the kernels a choice is made among: a store written before the widened way stands no more
    assert store.fields["bfloat16Kernels"] == "bf16_gemm,bf16_gemm_widened,avx2_gemm"
    assert (
        engine_gemm_store(EngineConfig(compile_cache_dir=str(tmp_path)), torch.bfloat16, (3, 5))
        is None
    )
    off = EngineConfig(compile=True, compile_cache_dir="none")
    assert engine_gemm_store(off, torch.bfloat16, (3, 5)) is None
    assert engine_gemm_store(compiling, torch.bfloat16, None) is None  # quantized layers


def test_a_compiling_engines_second_start_takes_the_first_ones_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real probes, as ``LoadedEngine`` runs them: the first start probes and stores, the
    second reads the choice. The neighbours' share is pinned to none, so that a busy machine
    does not keep the first start from storing (``undisturbed`` is tested on its own)."""
    monkeypatch.setattr(cpu_share, "neighbour_share", lambda run: (run(), 0.0))
    config = EngineConfig(compile=True, compile_cache_dir=str(tmp_path))
    cpu = torch.device("cpu")
    first = engine_probe_kernels(config, SHAPE, cpu, torch.bfloat16)
    if first.gemm_probe is None:
        pytest.skip("nothing to probe: no bfloat16 GEMM choice on this device")
    second = engine_probe_kernels(config, SHAPE, cpu, torch.bfloat16)
    assert not first.gemm_probe.stored and second.gemm_probe.stored  # type: ignore[union-attr]
    assert second == first and repr(second) == repr(first)  # the compile cache's key field


PUBLISH = """
import json, sys, torch
from llmpool.engine.gemm_store import GemmStore
from llmpool.engine.kernels import capabilities
from llmpool.engine.kernels.capabilities import probe_kernels
capabilities.PROBE_PATIENCE_S = 45  # so that one of the three, desynchronised, settles
print("ready", flush=True)
sys.stdin.readline()
kernels = probe_kernels(torch.device("cpu"), torch.bfloat16, (3072, 576), GemmStore(
    __import__("pathlib").Path(sys.argv[1]), {"test": "replicas"}))
print(json.dumps([repr(kernels.gemm), kernels.gemm_probe.stored]))
"""


@pytest.mark.slow
def test_replicas_probing_at_once_run_the_same_gemms(tmp_path: Path) -> None:
    """Three engines probe at the same moment with one store, on a machine with fewer CPUs than
    that: each runs the choice published first (its own, or another's it then takes), whatever
    each measured, also those whose probes never had the CPUs to themselves."""
    engines = [
        subprocess.Popen(
            [sys.executable, "-c", PUBLISH, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(3)
    ]
    assert [e.stdout.readline().strip() for e in engines] == ["ready"] * 3  # type: ignore[union-attr]
    for engine in engines:
        engine.stdin.write("go\n")  # type: ignore[union-attr]
        engine.stdin.flush()  # type: ignore[union-attr]
    results = [json.loads(e.communicate(timeout=300)[0].splitlines()[-1]) for e in engines]
    assert [e.returncode for e in engines] == [0, 0, 0]
    stored = GemmStore(tmp_path, {"test": "replicas"}).load()
    if stored is None:
        pytest.skip("no probe ran settled (a busy machine): nothing was published")
    assert {gemm for gemm, _ in results} == {repr(stored.gemm)}
