"""Readiness means a forward pass has run: the server warms the engine up before it listens."""

from __future__ import annotations

from llmpool.engine.llm import LLM
from llmpool.engine.server.app import warm_up


def test_warm_up_runs_a_whole_step_and_leaves_nothing_behind() -> None:
    llm = LLM(max_model_len=256, kv_cache_memory="16MiB", dtype="float32")
    core = llm.engine
    assert core.runner.timings.steps == 0
    warm_up(core)
    assert core.runner.timings.steps >= 1 and core.runner.timings.forward > 0
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert not core.has_unfinished_requests() and not core.detokenizers
