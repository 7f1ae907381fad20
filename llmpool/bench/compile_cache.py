"""Engine start-up with the compiled decoder: eager, cold compiled and warm compiled, each a fresh
process, as ratios to eager.

"cold" has an empty compile cache and empty inductor caches (a new node); "warm" loads the
compile cache that "cold" wrote, with inductor's local caches empty again (a new replica of a
pool sharing the cache volume); "warm local" also keeps inductor's local caches (the same
container restarted). Each child times building the engine (load, KV pool, compile) and
reports the compile's cache state. The compile runs beside serving (engine/background_compile.py),
so each child times two moments: "ready", the engine built and taking requests (eager until the
compile ends; the ratio to eager is of this one), and "compiled", the compiled decoder in use.
dynamo's own compile-time breakdown says where the compile's time goes (dynamo tracing vs
inductor). Each start also says which GEMMs it chose and whether it read that choice from the
GEMM store beside the cache (``engine/gemm_store.py``): the choice is part of the cache's key.

    python benchmarks/compile_cache.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from llmpool.bench.results import RESULTS, script_command, write_json

CHILD = """
import json, sys, time
import torch
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.config import EngineConfig
config = EngineConfig(**json.loads(sys.argv[1]))
started = time.monotonic()
core = EngineCore(config)
seconds = time.monotonic() - started
core.wait_for_compile()
compiled = time.monotonic() - started
times = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
probe = core.kernels.gemm_probe
print(json.dumps({"seconds": seconds, "compiled_seconds": compiled, "report": core.compile_report.as_dict(),
                  "gemm": core.kernels.gemm.as_observed(),
                  "gemmProbe": None if probe is None else probe.as_observed(),
                  "phases": dict(zip(*times)) if config.compile else {}}))
"""
# dynamo's phases that say where a compiled start's time goes.
PHASES = {
    "_compile.compile_inner": "dynamo and everything below it",
    "bytecode_tracing": "dynamo tracing",
    "OutputGraph.call_user_compiler": "AOT autograd and inductor",
    "async_compile.wait": "C++ builds",
}


def start(settings: dict[str, Any], cache_dir: Path, inductor_dir: Path) -> dict[str, Any]:
    """One engine start in a fresh process with these caches: seconds to ready and to the
    compiled decoder, the compile's report and dynamo's phases."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    config = {**settings, "compile_cache_dir": str(cache_dir)}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(config)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    measured = json.loads(result.stdout.splitlines()[-1])
    phases = measured.pop("phases")
    measured["phases"] = {name: round(float(phases[name]), 1) for name in PHASES if name in phases}
    return measured


def run(settings: dict[str, Any], scratch: Path) -> dict[str, Any]:
    cache, local = scratch / "compile", scratch / "inductor-local"
    runs = {
        "eager": (False, scratch / "inductor-eager"),
        "cold": (True, local),
        "warm": (True, scratch / "inductor-warm"),
        "warm_local": (True, local),
    }
    starts = {}
    for name, (compiled, inductor_dir) in runs.items():
        measured = start({**settings, "compile": compiled}, cache, inductor_dir)
        measured["ratio_to_eager"] = round(
            measured["seconds"] / starts.get("eager", measured)["seconds"], 2
        )
        measured["seconds"] = round(measured["seconds"], 2)
        measured["compiled_seconds"] = round(measured["compiled_seconds"], 2)
        starts[name] = measured
        print(
            f"{name:>10}: ready {measured['seconds']:7.1f} s  {measured['ratio_to_eager']:6.2f}x"
            f" eager  compiled {measured['compiled_seconds']:7.1f} s  cache {measured['report']['cache']:<4}"
            f"  GEMM choice {'stored' if (measured['gemmProbe'] or {}).get('stored') else 'probed'}"
            f"  {measured['phases']}",
            flush=True,
        )
    return starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_cache.json")
    args = parser.parse_args()
    settings = {"dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens}
    with tempfile.TemporaryDirectory(prefix="llmpool-compile-cache-") as scratch:
        starts = run(settings, Path(scratch))
    write_json(args.out, {"settings": settings, "starts": starts}, script_command(__file__))
