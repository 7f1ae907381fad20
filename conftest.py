"""Policy for every pytest run in this repository (tests/ and e2e/): on CI, a skip fails.

A skipped test hides the feature it checks, and a CI run that skips it passes silently. With
``CI=true`` (set by CI services and by scripts/test.sh) every skip becomes a failure, unless
its reason is in ``ALLOWED_CI_SKIPS``: skips about the machine, never about the code.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

pytest_plugins = ("pytester",)  # tests/test_ci_skips.py runs this policy on throwaway suites

ALLOWED_CI_SKIPS = {
    # The Triton kernel tests compiled for CUDA (LLMPOOL_KERNEL_TEST_DEVICE=cuda) need a GPU,
    # which CI machines do not have; CI runs the same tests under the Triton interpreter on CPU,
    # and benchmarks/gpu_check.py runs them compiled on a GPU machine.
    "LLMPOOL_KERNEL_TEST_DEVICE=cuda but no GPU is visible": "a CUDA-only run on a CPU machine",
    # The C kernels for AVX-512 (bfloat16 GEMM, VNNI) have no other build, and CI machines differ:
    # some have only AVX2. There the engine runs its torch paths, which the rest of the suite
    # tests; tests.conftest.needs_cpu skips only on the missing flags, never on a failed build.
    "this CPU lacks ": "a kernel for instructions this machine does not have",
}


def strict_skips() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return message.removeprefix("Skipped: ")


def fail_hidden_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Turn a skip that is not allow-listed into a failure that names its reason."""
    if not strict_skips() or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if any(reason.startswith(allowed) for allowed in ALLOWED_CI_SKIPS):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped with CI=true: {reason}\nA skip on CI hides what the test checks; provide"
        " what it needs, or add a skip that is about the machine to ALLOWED_CI_SKIPS in"
        " conftest.py with the reason it is one."
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    fail_hidden_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    fail_hidden_skip(report)
    return report
