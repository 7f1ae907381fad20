"""The `llmpool` console script: one subcommand per tool, each parsing its own arguments."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with `main(argv) -> int`, one-line help)
SUBCOMMANDS = {
    "serve": ("llmpool.engine.server.cli", "serve a model over an OpenAI-compatible HTTP API"),
    "bench": ("llmpool.bench", "benchmarks: `bench offline` (engine vs HF) and `bench serve`"),
    "operator": ("llmpool.operator.main", "run the LLMPool Kubernetes operator"),
    "gateway": ("llmpool.gateway.cli", "one OpenAI endpoint for every pool, routed by cache"),
    "plan": ("llmpool.plan", "weight and KV memory of a deployment, and how many sequences fit"),
    "digest": ("llmpool.digest", "the sha256 revision of a model or LoRA adapter folder, to pin"),
}


def usage() -> str:
    lines = ["usage: llmpool <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] == "--version":
        from llmpool import __version__

        print(__version__)
        return 0
    if args[0] not in SUBCOMMANDS:
        print(f"llmpool: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
