"""``python benchmarks/layer_ops.py``: runs the benchmark ``llmpool.bench.layer_ops`` (its docstring says what it measures)."""

from llmpool.bench.layer_ops import main

if __name__ == "__main__":
    raise SystemExit(main())
