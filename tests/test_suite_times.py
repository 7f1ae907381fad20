"""benchmarks/suite_times.py: a run's stages and JUnit files summed by stage, test file and test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from llmpool.bench import suite_times

ROOT = Path(__file__).resolve().parents[1]


def junit(cases: list[tuple[str, str, float, str]]) -> str:
    """A pytest-style JUnit file of (classname, name, seconds, outcome) cases."""
    body = {
        "passed": "",
        "failed": '<failure message="boom"/>',
        "skipped": '<skipped message="no"/>',
    }
    rows = "".join(
        f'<testcase classname="{c}" name="{n}" time="{t}">{body[o]}</testcase>'
        for c, n, t, o in cases
    )
    return (
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>'
    )


def test_a_run_is_summed_by_stage_file_and_test(tmp_path: Path) -> None:
    (tmp_path / "stages.tsv").write_text("lint\t3\t0\nunit\t120\t0\ne2e\t600\t1\n")
    (tmp_path / "unit.xml").write_text(
        junit(
            [
                ("tests.server.test_api", "test_a", 10.0, "passed"),
                ("tests.server.test_api.TestGroup", "test_b", 30.5, "failed"),
                ("tests.test_sampler", "test_c[1]", 20.0, "skipped"),
            ]
        )
    )
    (tmp_path / "e2e.xml").write_text(junit([("e2e.tests.test_helm", "test_d", 300.0, "passed")]))

    summary = suite_times.summarize(tmp_path)

    assert summary["stages"] == [
        {"stage": "lint", "seconds": 3.0, "status": 0},
        {"stage": "unit", "seconds": 120.0, "status": 0},
        {"stage": "e2e", "seconds": 600.0, "status": 1},
    ]
    assert summary["total_seconds"] == 723.0
    assert summary["tests"] == {
        "e2e": {"passed": 1},
        "unit": {"passed": 1, "failed": 1, "skipped": 1},
    }
    assert summary["files"] == [
        {"file": "e2e/tests/test_helm.py", "seconds": 300.0, "tests": 1},
        {"file": "tests/server/test_api.py", "seconds": 40.5, "tests": 2},
        {"file": "tests/test_sampler.py", "seconds": 20.0, "tests": 1},
    ]
    assert [entry["test"] for entry in summary["slowest"][:2]] == [
        "e2e/tests/test_helm.py::test_d",
        "tests/server/test_api.py::test_b",
    ]
    assert "e2e                         10.0 min   1" in suite_times.render(summary)


def test_record_keeps_each_label_beside_the_others(tmp_path: Path) -> None:
    times = tmp_path / "times"
    times.mkdir()
    (times / "stages.tsv").write_text("unit\t60\t0\n")
    (times / "unit.xml").write_text(junit([("tests.test_x", "test_y", 1.0, "passed")]))
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for label in ("cold", "warm"):
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "suite_times.py"),
             "--times", str(times), "--record", label],
            cwd=tmp_path, check=True, capture_output=True,
        )  # fmt: skip
    recorded = json.loads((tmp_path / "benchmarks" / "results" / "suite_times.json").read_text())
    assert sorted(recorded) == ["cold", "warm"]
    assert recorded["warm"]["command"].endswith("--record warm")
    assert recorded["warm"]["total_seconds"] == 60.0
