"""The repository's conftest.py policy: with CI=true a skip fails unless it is allow-listed."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SUITE = """
import pytest

def test_passes():
    pass

def test_skipped_for_a_missing_tool():
    pytest.skip("no helm binary on PATH")

@pytest.mark.skipif(True, reason="`llmpool serve` is not there yet")
def test_skipped_by_marker():
    pass

def test_skipped_on_a_cpu_machine():
    pytest.skip("LLMPOOL_KERNEL_TEST_DEVICE=cuda but no GPU is visible")

@pytest.mark.xfail(reason="a known bug")
def test_expected_to_fail():
    assert False
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(ROOT_CONFTEST.read_text().replace('("pytester",)', "()"))
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_without_ci_skips_stay_skips(suite: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    result = suite.runpytest_inprocess()
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)


def test_with_ci_a_skip_that_hides_a_feature_fails(suite: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest_inprocess("-ra")
    # The allow-listed CPU-machine skip stays a skip; the xfail is not a skip.
    result.assert_outcomes(passed=1, skipped=1, xfailed=1, errors=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*skipped with CI=true: no helm binary on PATH*",
            "*skipped with CI=true: `llmpool serve` is not there yet*",
        ]
    )
    assert result.ret != 0


def test_with_ci_a_module_level_skip_fails_the_collection(
    suite: pytest.Pytester, monkeypatch
) -> None:
    suite.makepyfile(
        test_module_skip="""
import pytest
pytest.importorskip("a_module_that_does_not_exist")

def test_never_collected():
    pass
"""
    )
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest_inprocess("test_module_skip.py")
    result.stdout.fnmatch_lines(["*skipped with CI=true: could not import*"])
    assert result.ret != 0
