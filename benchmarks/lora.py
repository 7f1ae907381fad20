"""``python benchmarks/lora.py``: runs the benchmark ``llmpool.bench.lora`` (its docstring says what it measures)."""

from llmpool.bench.lora import main

if __name__ == "__main__":
    raise SystemExit(main())
