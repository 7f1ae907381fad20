"""What every benchmark shares: the one percentile, the result stamp, the engine launcher."""

from __future__ import annotations

import json
import math
import shlex
import threading
from pathlib import Path

import numpy as np
import pytest

from llmpool.bench import results
from llmpool.bench.launch import build_in_ended_thread
from llmpool.bench.stats import percentile, percentiles
from llmpool.engine import cpu_features


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 21)]  # rank 0.95 * 19 = 18.05: between 19 and 20
    assert percentile(values, 95) == pytest.approx(19.05)
    assert percentile(values, 95) == float(np.percentile(values, 95))
    assert percentile(values, 50) == 10.5
    assert math.isnan(percentile([], 95))


def test_percentiles_scale_and_empty() -> None:
    stats = percentiles([0.001, 0.002, 0.003])
    assert stats["mean"] == pytest.approx(2.0)
    assert stats["p50"] == pytest.approx(2.0)
    assert set(stats) == {"mean", "p50", "p95", "p99"}
    assert all(math.isnan(value) for value in percentiles([]).values())


def test_cpu_model_reads_the_model_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    text = "processor\t: 0\nmodel name\t: Example CPU @ 2.00GHz\nflags\t\t: fpu avx2\n"
    assert cpu_features.cpu_model(text) == "Example CPU @ 2.00GHz"
    monkeypatch.setattr(cpu_features, "CPUINFO", tmp_path / "no-such-file")
    assert cpu_features.cpu_model()  # platform.processor() or "unknown CPU"


def test_result_files_start_with_command_and_cpu(tmp_path: Path) -> None:
    command = results.script_command("/anywhere/llmpool/bench/decode_step.py", ["--rounds", "2"])
    assert shlex.split(command) == ["python", "benchmarks/decode_step.py", "--rounds", "2"]
    written = results.write_json(tmp_path / "out" / "r.json", {"rows": [1]}, command)
    on_disk = json.loads((tmp_path / "out" / "r.json").read_text())
    assert on_disk == written
    assert list(on_disk)[:4] == ["command", "cpu", "cpu_flags", "cpus"]
    assert on_disk["command"] == command and on_disk["rows"] == [1]
    assert on_disk["cpu"] == cpu_features.cpu_model()


def test_build_in_ended_thread() -> None:
    built_in: list[threading.Thread] = []
    value = build_in_ended_thread(lambda: built_in.append(threading.current_thread()) or 7)
    assert value == 7
    assert built_in[0] is not threading.current_thread()
    assert not built_in[0].is_alive()


def test_grouped_bars_draws_a_png(tmp_path: Path) -> None:
    rows = {"off": {"p50": 1.0, "p95": 2.0}, "on": {"p50": 0.5, "p95": 1.0}}
    path = tmp_path / "bars.png"
    results.grouped_bars(rows, {"p50": "p50", "p95": "p95"}, list(rows), "s", "title", path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_a_module_at_a_revision_loads_beside_the_current_one() -> None:
    """``module_at_revision`` (benchmarks' ``--against``): the committed sampler, loaded from git
    under a name of its own, samples as the current one does."""
    import torch

    from llmpool.bench.revision import module_at_revision
    from llmpool.engine import SamplingParams, sampler
    from llmpool.engine.request import Request

    committed = module_at_revision(Path(sampler.__file__), "HEAD")
    assert committed.__name__ == "sampler_at_HEAD" and committed.Sampler is not sampler.Sampler
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    requests = [Request(str(i), [1], SamplingParams(temperature=0), frozenset()) for i in range(3)]
    expected = logits.argmax(dim=-1).tolist()
    assert committed.Sampler()(logits, requests).token_ids == [[t] for t in expected]
