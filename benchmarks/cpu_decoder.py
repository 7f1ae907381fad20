"""``python benchmarks/cpu_decoder.py``: runs the benchmark ``llmpool.bench.cpu_decoder`` (its docstring says what it measures)."""

from llmpool.bench.cpu_decoder import main

if __name__ == "__main__":
    raise SystemExit(main())
