"""The start-up GEMM probes choose as on a quiet CPU while neighbours start beside them: what
other processes used is read from /proc/stat (``cpu_share``), and a disturbed probe runs again
(``capabilities.undisturbed``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from llmpool.engine.kernels import capabilities, cpu_share
from llmpool.engine.kernels.capabilities import (
    GemmDecision,
    GemmProbe,
    KernelCapabilities,
    bfloat16_kernel,
    probe_kernels,
)
from llmpool.engine.models import linear
from llmpool.engine.models.linear import GemmChoice

STAT = """cpu  900 90 900 9000 90 9 9 9 50 0
cpu0 100 10 200 4000 40 1 2 3 50 0
cpu1 400 40 300 5000 50 4 5 6 0 0
intr 12345
"""
# SmolLM2-135M's widest dense projection (gate and up), which the engine probes on.
GATE_UP = (2 * 1536, 576)


@contextmanager
def hogs(seconds: float) -> Iterator[None]:
    """A process spinning on each of this process's CPUs for ``seconds``."""
    spin = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in os.sched_getaffinity(0)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_busy_seconds_sums_the_busy_fields_of_the_cpus_asked() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    # user nice system irq softirq steal; idle, iowait and guest (inside user) are not busy
    assert cpu_share.busy_seconds({0}, STAT) == (100 + 10 + 200 + 1 + 2 + 3) / ticks
    assert cpu_share.busy_seconds({0, 1}, STAT) == (316 + 400 + 40 + 300 + 4 + 5 + 6) / ticks
    assert cpu_share.busy_seconds({7}, STAT) is None  # a CPU /proc/stat does not list
    assert cpu_share.busy_seconds({0}, "") is None


def spin(seconds: float) -> int:
    end, turns = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        turns += 1
    return turns


def test_neighbour_share_leaves_out_this_process_and_counts_the_others() -> None:
    turns, alone = cpu_share.neighbour_share(lambda: spin(0.5))
    assert turns > 0 and alone is not None
    # This process kept one CPU busy throughout; none of that is a neighbour's.
    assert alone < 0.3
    with hogs(3):
        time.sleep(0.3)  # the hogs are running
        _, crowded = cpu_share.neighbour_share(lambda: spin(1.0))
    # Each CPU had a hog, and this process's own thread took part of one.
    assert crowded is not None and crowded > 0.5


CHOSEN_ELSEWHERE = GemmDecision(
    GemmChoice(bfloat16_kernel_max_rows=64), "stored", GemmProbe(1, 0.0)
)


class Clock:
    """``time`` for :func:`capabilities.undisturbed`: sleeping advances it."""

    def __init__(self) -> None:
        self.now, self.pauses = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def probe_answers(
    monkeypatch: pytest.MonkeyPatch, shares: list[float | None], run_seconds: float = 0.0
) -> tuple[list[tuple[GemmChoice, str]], Clock]:
    """Probe runs that saw ``shares`` of the CPUs used by neighbours, each answering a
    different choice (its index as max rows), each taking ``run_seconds``."""
    answers = [(GemmChoice(bfloat16_kernel_max_rows=i), f"run {i}") for i in range(len(shares))]
    calls = iter(zip(answers, shares, strict=True))
    clock = Clock()

    def neighbour_share(run):  # type: ignore[no-untyped-def]
        answer, share = next(calls)
        clock.now += run_seconds
        return answer, share

    monkeypatch.setattr(cpu_share, "neighbour_share", neighbour_share)
    monkeypatch.setattr(capabilities, "time", clock)
    return answers, clock


def test_a_disturbed_probe_runs_again_after_a_pause_until_one_is_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers, clock = probe_answers(monkeypatch, [0.6, 0.3, 0.05])
    answer, probe = capabilities.undisturbed(pytest.fail)
    assert answer == answers[2] and probe == GemmProbe(attempts=3, neighbour_share=0.05)
    assert len(clock.pauses) == 2
    assert all(
        capabilities.PROBE_PAUSE_S[0] <= p <= capabilities.PROBE_PAUSE_S[1] for p in clock.pauses
    )


def test_a_long_probe_pauses_as_many_times_its_own_duration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replicas that start together keep their runs apart however long a run takes."""
    low, high = capabilities.PROBE_PAUSE_S
    _, clock = probe_answers(monkeypatch, [0.6, 0.6, 0.05], run_seconds=3.0)
    capabilities.undisturbed(pytest.fail)
    assert len(clock.pauses) == 2
    assert all(3.0 * low <= pause <= 3.0 * high for pause in clock.pauses), clock.pauses


def test_a_quiet_or_unmeasurable_probe_stands_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    answers, clock = probe_answers(monkeypatch, [None])
    assert capabilities.undisturbed(pytest.fail) == (answers[0], GemmProbe(1, None))
    assert clock.pauses == []


def test_past_its_patience_the_least_disturbed_run_stands_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(capabilities, "PROBE_PAUSE_S", (10.0, 10.0))
    monkeypatch.setattr(capabilities, "PROBE_PATIENCE_S", 25.0)
    answers, clock = probe_answers(monkeypatch, [0.5, 0.3, 0.45, 0.4])
    with caplog.at_level(logging.WARNING, logger=capabilities.__name__):
        answer, probe = capabilities.undisturbed(pytest.fail)
    assert clock.pauses == [10.0, 10.0, 10.0]  # at 0, 10 and 20 s; the fourth run ends it
    assert answer == answers[1] and probe == GemmProbe(attempts=4, neighbour_share=0.3)
    assert "may not be this CPU's" in caplog.text
    assert "30% of the CPUs used by other processes" in caplog.text
    assert probe.as_observed() == {"attempts": 4, "neighbourShare": 0.3, "stored": False}


def test_a_patience_given_replaces_the_default_and_zero_takes_one_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``--gemm-probe-patience``: an engine on a node known to be busy (a test cluster, a
    scale-from-zero pool that must start fast) gives its choice up after one disturbed run."""
    answers, clock = probe_answers(monkeypatch, [0.6, 0.05])
    with caplog.at_level(logging.WARNING, logger=capabilities.__name__):
        answer, probe = capabilities.undisturbed(pytest.fail, patience_s=0.0)
    assert answer == answers[0] and probe == GemmProbe(attempts=1, neighbour_share=0.6)
    assert clock.pauses == [] and "for 0 s" in caplog.text


def test_a_disturbed_probe_stops_once_another_start_stored_a_choice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Replicas starting together: this one's probes never settle, another's did and stored
    its choice after this one's first run; the second run is the last, without a warning."""
    answers, clock = probe_answers(monkeypatch, [0.6, 0.5, 0.7])
    looks = iter([None, CHOSEN_ELSEWHERE])
    with caplog.at_level(logging.INFO, logger=capabilities.__name__):
        answer, probe = capabilities.undisturbed(pytest.fail, stored_meanwhile=lambda: next(looks))
    assert answer == answers[1] and probe == GemmProbe(attempts=2, neighbour_share=0.5)
    assert len(clock.pauses) == 1
    assert "another start stored its choice meanwhile" in caplog.text
    assert "may not be this CPU's" not in caplog.text


def test_how_the_probes_ran_is_no_part_of_the_capabilities_nor_of_the_compile_key() -> None:
    """The compile cache keys on the capabilities' repr (``engine_builder.compile_cache``): a
    field that differs at every start would make every start a miss."""
    quiet = KernelCapabilities(
        gemm=GemmChoice(bfloat16_kernel_max_rows=64), gemm_probe=GemmProbe(1, 0.01)
    )
    retried = replace(quiet, gemm_probe=GemmProbe(3, 0.2))
    assert quiet == retried and repr(quiet) == repr(retried)
    assert "gemm_probe" not in repr(quiet) and "bfloat16_kernel_max_rows=64" in repr(quiet)


PROBE = f"""
import json, sys, torch
from llmpool.engine.kernels import capabilities
from llmpool.engine.kernels.capabilities import probe_kernels
capabilities.PROBE_PATIENCE_S = 60  # a slow CPU's probes take longer; the question is the runs'
print("ready", flush=True)
sys.stdin.readline()
kernels = probe_kernels(torch.device("cpu"), torch.bfloat16, {GATE_UP})
print(json.dumps([kernels.gemm.bfloat16_kernel_max_rows, kernels.gemm_probe.as_observed()]))
"""


@pytest.mark.slow
def test_engines_probing_together_beside_busy_neighbours_choose_as_a_quiet_one() -> None:
    """The failure this guards: four servers starting at once on a 2-core EPYC, one of them
    measured its C kernel at 1.02x torch's (1.7-2.3x quiet) and ran its decodes 2.6x slower.
    Two engines probe at once, starting while a process spins on each CPU: each sees its first
    run disturbed, probes again, and keeps a quiet run's choice."""
    quiet = probe_kernels(torch.device("cpu"), torch.bfloat16, GATE_UP)
    if bfloat16_kernel(quiet) is None or quiet.gemm.bfloat16_kernel_max_rows is None:
        pytest.skip("no few-row bfloat16 C kernel wins on this CPU, quiet")
    engines = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    assert [engine.stdout.readline().strip() for engine in engines] == ["ready", "ready"]  # type: ignore[union-attr]
    with hogs(2):
        time.sleep(0.3)  # the hogs are running
        for engine in engines:
            engine.stdin.write("go\n")  # type: ignore[union-attr]
            engine.stdin.flush()  # type: ignore[union-attr]
        outputs = [engine.communicate(timeout=120)[0] for engine in engines]
    assert [engine.returncode for engine in engines] == [0, 0]
    for output in outputs:
        max_rows, probe = json.loads(output.strip().splitlines()[-1])
        assert probe["attempts"] >= 2
        assert probe["neighbourShare"] <= capabilities.PROBE_NEIGHBOUR_SHARE_MAX
        # Decode rows run in the C kernel, as the quiet probe chose (how far up it reaches sits
        # near the 1.1x threshold even on a quiet CPU, so the rows themselves may differ).
        assert max_rows is not None


@pytest.mark.parametrize(
    ("speedups", "in_c_decoder", "max_rows"),
    [
        ({8: 1.4, 16: 0.7, 32: 0.9}, False, 8),  # layer by layer: 1.1x or more
        ({8: 1.4, 16: 0.7, 32: 0.9}, True, 16),  # a decode step of up to 16 rows in one C call
        ({8: 1.4, 16: 0.5}, True, 8),  # too slow even so
        ({8: 2.0, 16: 2.0, 32: 1.0}, True, 16),  # past 16 rows the bar is 1.1x again
    ],
)
def test_the_kernel_takes_the_rows_a_c_decoder_step_gains_on(
    monkeypatch: pytest.MonkeyPatch, speedups: dict[int, float], in_c_decoder: bool, max_rows: int
) -> None:
    """An Intel Xeon with AMX: oneDNN's GEMM outruns the kernel at 16 rows, yet a decode step of
    16 requests runs 1.23x as fast in the C decoder (whose GEMMs are the kernel's)."""
    monkeypatch.setattr(
        linear, "probe_bfloat16_kernel", lambda weights, kernel, rows, against=None: speedups[rows]
    )
    rows, says = capabilities.bfloat16_kernel_rows([torch.zeros(4, 4)], "bf16_gemm", in_c_decoder)
    assert rows == max_rows
    assert ("in one C call" in says) == in_c_decoder


@pytest.mark.parametrize(
    ("at_32", "at_1", "chosen"),
    [
        (1.31, 1.27, "bf16_gemm_widened"),  # an Intel Xeon with AVX-512 BF16 and no AMX
        (1.31, 0.97, "bf16_gemm_widened"),  # a single request no slower, within the noise
        (0.5, 0.9, "bf16_gemm"),  # a Zen 4 EPYC: vdpbf16ps at twice the FMAs' flop rate
        (1.31, 0.8, "bf16_gemm"),  # a single request's decode would lose
        (1.05, 1.3, "bf16_gemm"),  # too close a lead where the rows are compute-bound
    ],
)
def test_the_widened_way_is_chosen_where_it_wins_at_32_rows_and_loses_nothing_at_one(
    monkeypatch: pytest.MonkeyPatch, at_32: float, at_1: float, chosen: str
) -> None:
    probed: list[tuple[str, int, str | None]] = []

    def probe(
        weights: list[torch.Tensor], kernel: str, rows: int, against: str | None = None
    ) -> float:
        probed.append((kernel, rows, against))
        return {32: at_32, 1: at_1}[rows]

    monkeypatch.setattr(linear, "probe_bfloat16_kernel", probe)
    names = capabilities.bfloat16_kernels(KernelCapabilities(bf16_gemm=True))
    kernel, says = capabilities.choose_bfloat16_kernel([torch.zeros(4, 4)], names)
    assert kernel == chosen
    assert probed == [("bf16_gemm_widened", 32, "bf16_gemm"), ("bf16_gemm_widened", 1, "bf16_gemm")]
    assert says == [
        f"bf16_gemm_widened runs 32 rows {at_32:.2f}x and 1 row {at_1:.2f}x as fast as"
        f" bf16_gemm, so {chosen} runs them"
    ]


def test_only_the_avx512_kernel_has_a_widened_way_to_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "probe_bfloat16_kernel", pytest.fail)
    names = capabilities.bfloat16_kernels(KernelCapabilities(avx2_gemm=True))
    assert names == ("avx2_gemm",)
    assert capabilities.choose_bfloat16_kernel([torch.zeros(4, 4)], names) == ("avx2_gemm", [])
    assert capabilities.bfloat16_kernels(KernelCapabilities()) == ()


def test_a_stored_widened_choice_runs_only_where_bf16_gemm_is_built() -> None:
    widened = GemmChoice(bfloat16_kernel_max_rows=128, bfloat16_kernel="bf16_gemm_widened")
    assert capabilities.runs_here(widened, KernelCapabilities(bf16_gemm=True))
    assert not capabilities.runs_here(widened, KernelCapabilities(avx2_gemm=True))


def test_the_probe_knows_whether_decode_steps_run_in_c() -> None:
    built = KernelCapabilities(cpu_decoder=True, cpu_decode=True, cpu_layer_ops=True)
    assert capabilities.decodes_in_c(built)
    assert not capabilities.decodes_in_c(replace(built, cpu_layer_ops=False))
