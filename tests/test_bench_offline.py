"""`llmpool bench offline`: its workload and how it reports a step's time."""

from __future__ import annotations

from llmpool.bench.offline import Result, breakdown, make_workload, markdown_table
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


def test_python_overhead_is_scheduling_plus_input_preparation() -> None:
    timings = StepTimings(schedule=0.5, prepare_inputs=1.5, forward=7.0, sample=1.0, steps=10)
    per_step, overhead = breakdown(timings)
    assert per_step == {
        "schedule": 50.0,
        "prepare_inputs": 150.0,
        "forward": 700.0,
        "sample": 100.0,
        "steps": 10,
    }
    assert overhead == 0.2


def test_table_rows_are_ordered_by_dtype_then_concurrency() -> None:
    per_step, overhead = breakdown(StepTimings(1.0, 1.0, 1.0, 1.0, 1))
    results = [
        Result("float32", concurrency, 10.0, 25.0, 2.5, per_step, overhead)
        for concurrency in (64, 1, 16)
    ]
    rows = markdown_table(results).splitlines()[2:]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "16", "64"]
    assert "2.50x" in rows[0] and "50.0%" in rows[0]
