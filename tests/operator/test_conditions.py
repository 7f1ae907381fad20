"""Conditions: lastTransitionTime moves only on a flip; flips raise Events."""

from __future__ import annotations

import pytest

from llmpool.operator.conditions import Condition, merge_conditions, transition_events

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def test_new_conditions_get_the_current_time():
    [ready] = merge_conditions(
        [], [Condition("Ready", "False", "RollingOut", "0/2")], generation=1, now=T0
    )
    assert ready == {
        "type": "Ready",
        "status": "False",
        "reason": "RollingOut",
        "message": "0/2",
        "lastTransitionTime": T0,
        "observedGeneration": 1,
    }


@pytest.mark.parametrize(
    ("then", "generation", "transition"),
    [
        (Condition("Ready", "False", "Scaling", "1/2"), 2, T0),  # same status: the rest updates
        (Condition("Ready", "True", "AllReplicasReady", ""), 1, T1),  # a flip
    ],
)
def test_the_transition_time_moves_only_on_a_flip(then, generation, transition):
    rolling = Condition("Ready", "False", "RollingOut", "0/2")
    before = merge_conditions([], [rolling], generation=1, now=T0)
    [ready] = merge_conditions(before, [then], generation=generation, now=T1)
    assert ready["lastTransitionTime"] == transition
    assert (ready["status"], ready["reason"], ready["message"]) == (
        then.status,
        then.reason,
        then.message,
    )
    assert ready["observedGeneration"] == generation


def test_order_is_stable_and_others_are_kept():
    previous = [
        {"type": "Custom", "status": "True", "reason": "X", "message": "", "lastTransitionTime": T0}
    ]
    merged = merge_conditions(
        previous,
        [
            Condition("Drifted", "False", "NoDrift", ""),
            Condition("Ready", "True", "AllReplicasReady", ""),
        ],
        generation=1,
        now=T1,
    )
    assert [c["type"] for c in merged] == ["Ready", "Drifted", "Custom"]


def conditions(**statuses: str) -> list[dict]:
    return [
        {
            "type": kind,
            "status": status,
            "reason": f"{kind}Reason",
            "message": "m",
            "lastTransitionTime": T0,
        }
        for kind, status in statuses.items()
    ]


def test_events_on_flips_only():
    before = conditions(Ready="False", Degraded="False", Drifted="False")
    after = conditions(Ready="True", Degraded="False", Drifted="True")
    events = {e.reason: e.type for e in transition_events(before, after)}
    assert events == {"ReadyReason": "Normal", "DriftedReason": "Warning"}


def test_losing_readiness_is_a_warning_and_recovery_is_normal():
    [lost] = transition_events(conditions(Ready="True"), conditions(Ready="False"))
    assert lost.type == "Warning"
    [back] = transition_events(conditions(Drifted="True"), conditions(Drifted="False"))
    assert back.type == "Normal"


def test_a_new_pool_raises_no_events_until_something_is_wrong():
    assert (
        transition_events([], conditions(Ready="False", Progressing="True", Degraded="False")) == []
    )
    [degraded] = transition_events([], conditions(Degraded="True"))
    assert degraded.type == "Warning"


def test_a_rollout_is_not_a_warning():
    before = conditions(Ready="True")
    after = [{**conditions(Ready="False")[0], "reason": "RollingOut"}]
    [event] = transition_events(before, after)
    assert event.type == "Normal" and event.reason == "RollingOut"
