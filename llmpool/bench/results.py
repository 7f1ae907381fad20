"""What every benchmark result file carries: the command that made it and the machine it ran on.

Numbers from different CPUs, thread counts or arguments are not comparable, so each JSON file
written under ``benchmarks/results/`` starts with ``command``, ``cpu``, ``cpu_flags`` and ``cpus``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmpool.engine.cpu_features import cpu_flags, cpu_model

# Relative to the working directory: every documented benchmark command runs from the
# repository root (as ``llmpool bench offline``'s default ``--out`` assumes too).
RESULTS = Path("benchmarks/results")


def cpu_description() -> dict[str, Any]:
    """The CPU's model name, its SIMD flags the kernels choose by, and the logical CPU count."""
    simd = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    return {"cpu": cpu_model(), "cpu_flags": simd, "cpus": os.cpu_count()}


def script_command(script: str, argv: Sequence[str] | None = None) -> str:
    """``python benchmarks/NAME.py ARGS``: how the benchmark module ``script`` (its
    ``__file__``; its entry point is the file of the same name in ``benchmarks/``) was run,
    with ``argv`` (default: this process's arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", f"benchmarks/{Path(script).name}", *args])


def write_json(path: Path, report: dict[str, Any], command: str) -> dict[str, Any]:
    """Write ``report`` to ``path`` as indented JSON, led by ``command`` and the CPU
    description; returns what was written."""
    stamped = {"command": command, **cpu_description(), **report}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamped, indent=2) + "\n")
    return stamped


def write_report(
    name: str, report: dict[str, Any], command: str, markdown: Callable[[dict[str, Any]], str]
) -> dict[str, Any]:
    """``RESULTS/name.json`` (stamped as ``write_json``) and ``RESULTS/name.md``, the markdown
    also printed; returns the stamped report."""
    stamped = write_json(RESULTS / f"{name}.json", report, command)
    text = markdown(stamped)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return stamped


def grouped_bars(
    results: dict[str, dict[str, Any]],
    bars: dict[str, str],
    names: list[str],
    ylabel: str,
    title: str,
    path: Path,
    figsize: tuple[float, float] = (5, 3.5),
) -> None:
    """One group of bars per result (labelled by ``names``), one bar per key of ``bars``
    (key -> legend label), saved as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=figsize)
    width = 0.8 / len(bars)
    for index, (key, label) in enumerate(bars.items()):
        offset = (index - (len(bars) - 1) / 2) * width
        axis.bar(
            [i + offset for i in range(len(results))],
            [result[key] for result in results.values()],
            width=width,
            label=label,
        )
    axis.set_xticks(range(len(names)), names, fontsize=8)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
