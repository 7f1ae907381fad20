"""`llmpool bench`: `serve` (load generator against an HTTP endpoint) and `offline` (engine vs HF)."""

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
