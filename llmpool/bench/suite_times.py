"""Where a run of ``scripts/test.sh`` spent its time: by stage, by test file and by test.

``scripts/test.sh`` writes, under its times directory (default ``build/test-times``),
``stages.tsv`` (one ``stage<TAB>seconds<TAB>exit status`` line per stage, in the order they
ended) and one JUnit XML file per pytest stage (``<stage>.xml``). This reads them and prints
the stages, the test files whose tests took longest (setup, call and teardown summed, the way
pytest's ``--durations`` counts them) and the slowest tests, with the test counts per stage.

    python benchmarks/suite_times.py                       # the last run of scripts/test.sh
    python benchmarks/suite_times.py --record LABEL        # kept in results/suite_times.json

``--record`` keeps the run under ``LABEL`` beside the other runs (cold and warm CI runs, before
and after a change), so that the budget of the suite is visible without a CI log at hand.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpool.bench.results import RESULTS, cpu_description, script_command

DEFAULT_TIMES = Path("build/test-times")
RECORDED = RESULTS / "suite_times.json"
SHOWN = 15


@dataclass(frozen=True)
class TestTime:
    stage: str
    file: str
    name: str
    seconds: float
    outcome: str  # passed, failed, error or skipped


def read_stages(times: Path) -> list[tuple[str, float, int]]:
    """``stages.tsv`` as (stage, seconds, exit status), in the order the stages ended."""
    rows = []
    for line in (times / "stages.tsv").read_text().splitlines():
        stage, seconds, status = line.split("\t")
        rows.append((stage, float(seconds), int(status)))
    return rows


def _outcome(case: ElementTree.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return "failed" if tag == "failure" else tag
    return "passed"


def _file_of(classname: str) -> str:
    """The test file of a JUnit ``classname`` (``tests.server.test_api.TestX`` or
    ``tests.server.test_api``): the dotted path up to its ``test_*`` module."""
    parts = classname.split(".")
    for index, part in enumerate(parts):
        if part.startswith("test_"):
            return "/".join(parts[: index + 1]) + ".py"
    return "/".join(parts) + ".py"


def read_tests(times: Path) -> list[TestTime]:
    """Every test case of every ``<stage>.xml``: its time is setup, call and teardown together
    (pytest's JUnit ``time`` with the default ``junit_duration_report = total``)."""
    tests = []
    for path in sorted(times.glob("*.xml")):
        for case in ElementTree.parse(path).getroot().iter("testcase"):
            tests.append(
                TestTime(
                    stage=path.stem,
                    file=_file_of(case.get("classname", "")),
                    name=case.get("name", ""),
                    seconds=float(case.get("time", "0")),
                    outcome=_outcome(case),
                )
            )
    return tests


def summarize(times: Path) -> dict[str, Any]:
    """The run's stages, its test files by time, its slowest tests and its counts."""
    stages = read_stages(times)
    tests = read_tests(times)
    by_file: dict[str, float] = defaultdict(float)
    count_by_file: dict[str, int] = defaultdict(int)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for test in tests:
        by_file[test.file] += test.seconds
        count_by_file[test.file] += 1
        counts[test.stage][test.outcome] += 1
    files = sorted(by_file.items(), key=lambda item: -item[1])
    slowest = sorted(tests, key=lambda test: -test.seconds)
    return {
        "stages": [{"stage": s, "seconds": round(t, 1), "status": rc} for s, t, rc in stages],
        "total_seconds": round(sum(t for _, t, _ in stages), 1),
        "tests": {stage: dict(outcomes) for stage, outcomes in counts.items()},
        "files": [{"file": f, "seconds": round(t, 1), "tests": count_by_file[f]} for f, t in files],
        "slowest": [
            {"test": f"{t.file}::{t.name}", "seconds": round(t.seconds, 1)} for t in slowest
        ][:50],
    }


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:5.1f} min"


def render(summary: dict[str, Any], shown: int = SHOWN) -> str:
    lines = ["stage                      time        status"]
    for stage in summary["stages"]:
        lines.append(f"{stage['stage']:<26} {_minutes(stage['seconds'])}   {stage['status']}")
    lines.append(f"{'total':<26} {_minutes(summary['total_seconds'])}")
    lines.append("")
    for stage, outcomes in summary["tests"].items():
        described = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
        lines.append(f"{stage}: {sum(outcomes.values())} tests ({described})")
    lines.append("")
    lines.append(f"test files by time (top {shown}):")
    for entry in summary["files"][:shown]:
        lines.append(f"  {entry['seconds']:7.1f}s  {entry['tests']:4d} tests  {entry['file']}")
    lines.append(f"slowest tests (top {shown}):")
    for entry in summary["slowest"][:shown]:
        lines.append(f"  {entry['seconds']:7.1f}s  {entry['test']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--times", type=Path, default=DEFAULT_TIMES, help="scripts/test.sh's times directory"
    )
    parser.add_argument("--record", metavar="LABEL", help=f"keep the run in {RECORDED}")
    parser.add_argument("--shown", type=int, default=SHOWN, help="files and tests listed")
    args = parser.parse_args(argv)
    summary = summarize(args.times)
    print(render(summary, args.shown))
    if args.record:
        recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
        recorded[args.record] = {
            "command": script_command(__file__, argv),
            **cpu_description(),
            **summary,
        }
        RECORDED.parent.mkdir(parents=True, exist_ok=True)
        RECORDED.write_text(json.dumps(recorded, indent=2) + "\n")
    return 0
