"""The autoscaler's decision on recorded load traces: the replica count it gives, pass by pass.

Each simulated pass is one operator pass (every 2 s); the state goes through the status dict
between passes, exactly as the operator keeps it, so these traces also show that an operator
restarted at any pass decides the same.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from itertools import pairwise

from llmpool.operator import autoscaling
from llmpool.operator.autoscaling import ScalerState, decide
from llmpool.operator.spec import AutoscalingSpec, PoolSpec

PASS_SECONDS = 2
START = 1_800_000_000  # any whole second
SPEC = AutoscalingSpec(
    min_replicas=1,
    max_replicas=8,
    target_in_flight_per_replica=4,
    window_seconds=60,
    scale_up_stabilization_seconds=30,
    scale_down_delay_seconds=120,
)

Trace = Callable[[int], float]  # seconds since the start -> the pool's load


def simulate(
    trace: Trace,
    seconds: int,
    spec: AutoscalingSpec = SPEC,
    *,
    start: int = 1,
    through_status: bool = True,
    hold_down: Callable[[int], bool] = lambda t: False,
) -> list[tuple[int, int, str]]:
    """``(second, new count, reason)`` for every change."""
    state = ScalerState.initial(spec, start)
    changes = []
    for t in range(0, seconds, PASS_SECONDS):
        decision = decide(spec, state, now=START + t, load=trace(t), hold_down=hold_down(t))
        if decision.changed:
            changes.append((t, decision.state.desired, decision.reason))
        state = ScalerState.from_status(decision.status()) if through_status else decision.state
    return changes


def test_step_scales_up_in_doubling_steps_then_down_one_at_a_time() -> None:
    def step(t: int) -> float:
        return 20.0 if 60 <= t < 360 else 0.0

    changes = simulate(step, 1200)
    ups = [c for c in changes if c[2] == autoscaling.SCALED_UP]
    downs = [c for c in changes if c[2] == autoscaling.SCALED_DOWN]
    assert [count for _, count, _ in ups] == [2, 4, 5]  # 20 / 4 per replica = 5, doubling at most
    assert [count for _, count, _ in downs] == [4, 3, 2, 1]  # to min, one per step
    assert changes == ups + downs  # no flapping: every up before every down
    # Each scale-up waits the stabilization time after the load (or the last step) asks.
    assert ups[0][0] - 60 >= SPEC.scale_up_stabilization_seconds
    assert all(b[0] - a[0] >= SPEC.scale_up_stabilization_seconds for a, b in pairwise(ups))
    # Scale-down waits the delay after the load stops and between steps.
    assert downs[0][0] - 360 >= SPEC.scale_down_delay_seconds
    assert all(b[0] - a[0] >= SPEC.scale_down_delay_seconds for a, b in pairwise(downs))
    assert changes == [
        (102, 2, "ScaledUp"),
        (134, 4, "ScaledUp"),
        (166, 5, "ScaledUp"),
        (486, 4, "ScaledDown"),
        (608, 3, "ScaledDown"),
        (730, 2, "ScaledDown"),
        (852, 1, "ScaledDown"),
    ]


def test_ramp_scales_up_only_and_stays_within_max() -> None:
    changes = simulate(lambda t: min(t / 10, 60.0), 900)
    counts = [count for _, count, _ in changes]
    assert counts == sorted(counts) and counts[-1] == SPEC.max_replicas
    assert all(new <= 2 * old for old, new in pairwise([1, *counts]))
    assert changes == [
        (102, 2, "ScaledUp"),
        (138, 3, "ScaledUp"),
        (180, 4, "ScaledUp"),
        (222, 5, "ScaledUp"),
        (258, 6, "ScaledUp"),
        (300, 7, "ScaledUp"),
        (342, 8, "ScaledUp"),
    ]


def test_a_spike_shorter_than_the_stabilization_time_changes_nothing() -> None:
    def spike(t: int) -> float:
        return 200.0 if 100 <= t < 110 else 1.0

    assert simulate(spike, 600) == []


def test_a_burst_longer_than_the_stabilization_time_scales_up_and_back() -> None:
    def burst(t: int) -> float:
        return 40.0 if 100 <= t < 160 else 1.0

    changes = simulate(burst, 900)
    assert changes == [
        (132, 2, "ScaledUp"),
        (164, 4, "ScaledUp"),
        (324, 3, "ScaledDown"),
        (446, 2, "ScaledDown"),
        (568, 1, "ScaledDown"),
    ]


def test_noise_around_a_level_settles_without_flapping() -> None:
    rng = random.Random(7)
    noise = [max(0.0, 10 + rng.uniform(-6, 6)) for _ in range(0, 1200, PASS_SECONDS)]
    changes = simulate(lambda t: noise[t // PASS_SECONDS], 1200)
    # 10 requests at 4 per replica: 3 replicas; reached in doubling steps, then held.
    assert changes == [(30, 2, "ScaledUp"), (90, 3, "ScaledUp")]


def test_from_zero_at_once_on_the_first_held_request_and_back_to_zero() -> None:
    spec = AutoscalingSpec(
        min_replicas=0,
        max_replicas=2,
        target_in_flight_per_replica=1,
        window_seconds=10,
        scale_up_stabilization_seconds=4,
        scale_down_delay_seconds=20,
    )

    def first_request(t: int) -> float:
        return 1.0 if 30 <= t < 40 else 0.0

    changes = simulate(first_request, 200, spec, start=0)
    assert changes[0] == (30, 1, "ScaledFromZero")
    assert changes[-1][1:] == (0, "ScaledDown")
    assert changes[-1][0] - 40 >= spec.scale_down_delay_seconds
    assert len(changes) == 2


def test_held_at_max_and_scale_down_held_during_a_rollout() -> None:
    spec = AutoscalingSpec(max_replicas=2, target_in_flight_per_replica=1, window_seconds=10)
    state = ScalerState.initial(spec, 2)
    decision = decide(spec, state, now=START, load=50.0)
    assert (decision.state.desired, decision.reason) == (2, autoscaling.HELD_AT_MAX)
    assert "asks for 50 replicas" in decision.message

    def idle(t: int) -> float:
        return 0.0

    quick = AutoscalingSpec(
        max_replicas=4, target_in_flight_per_replica=1, window_seconds=10,
        scale_down_delay_seconds=20,
    )  # fmt: skip
    held = simulate(idle, 200, quick, start=4, hold_down=lambda t: t < 100)
    free = simulate(idle, 200, quick, start=4)
    assert held[0][0] >= 100 and free[0][0] < 100
    state = ScalerState.initial(quick, 4)
    decision = decide(quick, state, now=START, load=0.0, hold_down=True)
    assert decision.reason == autoscaling.SCALE_DOWN_HELD


def test_an_operator_restart_changes_no_decision() -> None:
    def step(t: int) -> float:
        return 20.0 if 60 <= t < 360 else 0.0

    assert simulate(step, 1200, through_status=True) == simulate(step, 1200, through_status=False)


def test_bounds_follow_a_changed_spec_and_a_new_pool_starts_where_its_deployment_is() -> None:
    assert ScalerState.initial(SPEC, 3).desired == 3
    assert ScalerState.initial(SPEC, None).desired == SPEC.min_replicas
    assert ScalerState.initial(SPEC, 50).desired == SPEC.max_replicas
    narrower = AutoscalingSpec(min_replicas=2, max_replicas=3)
    assert decide(narrower, ScalerState(desired=1), now=START, load=0).state.desired == 2
    assert decide(narrower, ScalerState(desired=6), now=START, load=0).state.desired == 3


def test_status_round_trip_keeps_the_whole_state() -> None:
    state = ScalerState(
        desired=3,
        window=(autoscaling.Sample(START, 2.5), autoscaling.Sample(START + 5, 4.0)),
        above_since=START + 1,
        below_since=None,
        last_scale_time=START - 60,
        last_change=autoscaling.SCALED_UP,
    )
    status = autoscaling.Decision(state, 3, 3.25, autoscaling.HELD_AT_MAX, "m").status()
    assert status["lastChange"] == autoscaling.SCALED_UP
    assert status["window"][0] == {"time": "2027-01-15T08:00:00Z", "load": 2.5}
    assert ScalerState.from_status(status) == state


def test_spec_reads_the_crd_fields() -> None:
    spec = PoolSpec.from_dict(
        {
            "model": {
                "source": "builtin://smollm2-135m-instruct",
                "revision": "sha256:" + "a" * 64,
            },
            "autoscaling": {"maxReplicas": 4, "minReplicas": 0, "targetInFlightPerReplica": 2.5},
        }
    )
    assert spec.autoscaling == AutoscalingSpec(
        max_replicas=4, min_replicas=0, target_in_flight_per_replica=2.5
    )
