"""`llmpool bench offline`: its workload and how it reports a step's time."""

from __future__ import annotations

import pytest

from llmpool.bench.offline import Result, breakdown, make_workload, markdown_table, parse_args, run
from llmpool.engine.model_runner import StepTimings


def test_workload_is_the_issue_workload_and_reproducible() -> None:
    workload = make_workload(64, (32, 512), (16, 256), vocab_size=49152, seed=0)
    assert len(workload.prompts) == len(workload.output_lens) == 64
    assert all(32 <= len(prompt) <= 512 for prompt in workload.prompts)
    assert all(16 <= n <= 256 for n in workload.output_lens)
    assert all(100 <= token < 49152 for prompt in workload.prompts for token in prompt)
    assert workload.requested_tokens == sum(workload.output_lens)
    assert make_workload(64, (32, 512), (16, 256), vocab_size=49152, seed=0) == workload
    assert make_workload(64, (32, 512), (16, 256), vocab_size=49152, seed=1) != workload


def test_python_overhead_is_every_host_side_phase_of_the_wall_time() -> None:
    timings = StepTimings(
        schedule=0.5, prepare_inputs=1.5, forward=6.0, sample=1.0, process_outputs=0.5, steps=10
    )
    per_step, overhead = breakdown(timings, elapsed=10.0)
    assert per_step == {
        "schedule": 50.0,
        "prepare_inputs": 150.0,
        "forward": 600.0,
        "sample": 100.0,
        "process_outputs": 50.0,
        "other": 50.0,
        "steps": 10,
    }
    # schedule + prepare + outputs + the 0.5 s no phase covers, of 10 s.
    assert overhead == 0.3


def test_table_rows_are_ordered_by_dtype_then_concurrency() -> None:
    per_step, overhead = breakdown(StepTimings(1.0, 1.0, 1.0, 1.0, 0.0, 1), elapsed=4.0)
    results = [
        Result("float32", concurrency, 10.0, 25.0, 2.5, per_step, overhead, 0, 17_700, 1.5)
        for concurrency in (64, 1, 16)
    ]
    rows = markdown_table(results).splitlines()[2:]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "16", "64"]
    assert "2.50x" in rows[0] and "50.0%" in rows[0] and "0 of 17,700" in rows[0]


@pytest.mark.slow
def test_every_level_runs_on_a_fresh_engine_with_nothing_cached() -> None:
    """An engine kept across levels would find the second level's prompts in its prefix cache."""
    args = parse_args(
        ["--dtypes", "float32", "--concurrency", "2,1", "--num-requests", "3"]
        + ["--prompt-len", "40", "48", "--output-len", "2", "3"]
    )
    results = list(run(args))
    assert [r.concurrency for r in results] == [2, 1]
    for result in results:
        assert result.prefix_cache_query_tokens >= 3 * 40
        assert result.prefix_cache_hit_tokens == 0
        assert result.hf_tokens_per_s > 0 and result.llmpool_tokens_per_s > 0
