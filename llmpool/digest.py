"""`llmpool digest PATH`: the sha256 revision of a model or LoRA adapter folder.

What to write into an LLMPool's ``spec.model.revision`` or ``spec.adapters[].revision``: the
digest the engine computes of the same files and refuses to serve others than.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmpool.engine import model_source


def digest(path: Path) -> str:
    if (path / model_source.ADAPTER_FILES[0]).exists():
        return model_source.adapter_digest(path)
    return model_source.resolve(str(path)).revision


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmpool digest", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="model or adapter folders")
    args = parser.parse_args(argv)
    for path in args.paths:
        try:
            print(f"{digest(path)}  {path}")
        except (OSError, ValueError) as error:
            print(f"llmpool digest: {path}: {error}", file=sys.stderr)
            return 2
    return 0
