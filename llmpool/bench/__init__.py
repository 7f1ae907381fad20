"""Benchmarks: the ``llmpool bench`` CLI and every benchmark ``benchmarks/*.py`` runs.

``llmpool bench serve`` (load generator against HTTP endpoints) and ``llmpool bench offline``
(engine vs HF) are subcommands; the other benchmarks are modules here whose entry points are
``python benchmarks/NAME.py`` (benchmarks/README.md lists them with their results). What they
share: ``stats`` (the one percentile), ``results`` (the CPU description and command each result
file starts with), ``launch`` (an engine built in a thread that ends, ``llmpool serve`` on a free
port) and ``steps`` (alternating step and GEMM timings).
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "serve": "llmpool.bench.serve",
    "offline": "llmpool.bench.offline",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: llmpool bench {{{','.join(SUBCOMMANDS)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]])
    return int(module.main(argv[1:]) or 0)
