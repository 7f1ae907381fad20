"""The autoscaler's decision: how many replicas a pool's load asks for, one pass at a time. Pure.

Each operator pass adds the pool's load (requests running and waiting on its replicas plus
those a gateway holds for it, ``llmpool.load``) to a moving window and averages it;
``ceil(average / targetInFlightPerReplica)``, within ``[minReplicas, maxReplicas]``, is the
count the load asks for. Against flapping, as HPA's behaviours and KubeAI's delays do:

- up: only once the average, and the average of the last few samples, have asked for more for
  ``scaleUpStabilizationSeconds``, and at most doubling per step (a spike shorter than that
  restarts the clock; a burst that outlives it scales, in steps);
- from zero: at once, on the first request held for the pool (nobody is served until then);
- down: only once both averages have asked for fewer for
  ``scaleDownDelaySeconds`` and the last change is that old too, one replica per step, and
  never while a rollout or a drift recreation is under way (the Deployment could remove the
  one healthy replica).

Everything a decision depends on is ``ScalerState``, which lives in ``status.autoscaling``
(times in whole seconds, as the status stores them), so an operator restarted mid-window
decides exactly as the one before it.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmpool.operator.spec import AutoscalingSpec

logger = logging.getLogger(__name__)

SCALED_UP = "ScaledUp"
SCALED_DOWN = "ScaledDown"
SCALED_FROM_ZERO = "ScaledFromZero"
HELD_AT_MAX = "HeldAtMax"
SCALE_DOWN_HELD = "ScaleDownHeld"
STABLE = "Stable"
CHANGES = (SCALED_UP, SCALED_DOWN, SCALED_FROM_ZERO)

SAMPLES_PER_WINDOW = 12  # a sample every window/12 seconds (never more than one per pass)
RECENT_SAMPLES = 3  # the recent load that must agree with the window's before a change


@dataclass(frozen=True)
class Sample:
    time: int  # unix seconds
    load: float


@dataclass(frozen=True)
class ScalerState:
    desired: int
    window: tuple[Sample, ...] = ()
    above_since: int | None = None  # the average has asked for more than desired since
    below_since: int | None = None  # ... for fewer since
    last_scale_time: int | None = None
    last_change: str = STABLE  # the reason of the last change

    @classmethod
    def initial(cls, spec: AutoscalingSpec, current: int | None) -> ScalerState:
        """A pool new to autoscaling starts where its Deployment is (or at min), within bounds."""
        start = spec.min_replicas if current is None else current
        return cls(desired=min(max(start, spec.min_replicas), spec.max_replicas))

    def to_status(self, load: float, reason: str, message: str) -> dict[str, Any]:
        status: dict[str, Any] = {
            "desiredReplicas": self.desired,
            "load": round(load, 3),
            "reason": reason,
            "message": message,
            "window": [{"time": _rfc3339(s.time), "load": s.load} for s in self.window],
        }
        for key, value in (
            ("aboveSince", self.above_since),
            ("belowSince", self.below_since),
            ("lastScaleTime", self.last_scale_time),
        ):
            if value is not None:
                status[key] = _rfc3339(value)
        return status

    @classmethod
    def kept_or_initial(
        cls,
        kept: Mapping[str, Any] | None,
        spec: AutoscalingSpec,
        current: int | None,
        *,
        pool: str,
    ) -> ScalerState:
        """The state kept in ``status.autoscaling``; ``initial`` when there is none, or none
        readable (logged: the window starts over)."""
        if kept:
            try:
                return cls.from_status(kept)
            except (KeyError, TypeError, ValueError) as error:
                logger.warning("%s: unreadable status.autoscaling, starting over: %r", pool, error)
        return cls.initial(spec, current)

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> ScalerState:
        reason = status.get("reason", STABLE)
        return cls(
            desired=int(status["desiredReplicas"]),
            window=tuple(
                Sample(_seconds(s["time"]), float(s["load"])) for s in status.get("window") or []
            ),
            above_since=_optional_seconds(status.get("aboveSince")),
            below_since=_optional_seconds(status.get("belowSince")),
            last_scale_time=_optional_seconds(status.get("lastScaleTime")),
            # The status shows HeldAtMax or ScaleDownHeld over the last change while they hold.
            last_change=reason if reason in CHANGES else status.get("lastChange", STABLE),
        )


@dataclass(frozen=True)
class Decision:
    state: ScalerState
    previous: int  # the desired count before this pass
    load: float  # the window's average
    reason: str
    message: str

    @property
    def changed(self) -> bool:
        return self.state.desired != self.previous

    def status(self) -> dict[str, Any]:
        status = self.state.to_status(self.load, self.reason, self.message)
        if self.reason not in CHANGES and self.state.last_change in CHANGES:
            status["lastChange"] = self.state.last_change
        return status


def _rfc3339(seconds: int) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds(value: str) -> int:
    parsed = datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ")
    return int(parsed.replace(tzinfo=datetime.UTC).timestamp())


def _optional_seconds(value: str | None) -> int | None:
    return None if value is None else _seconds(value)


def _window(spec: AutoscalingSpec, state: ScalerState, now: int, load: float) -> tuple[Sample, ...]:
    """The window with this pass's sample added (if a sample period has passed) and old ones out."""
    period = max(1, spec.window_seconds // SAMPLES_PER_WINDOW)
    window = state.window
    if not window or now - window[-1].time >= period:
        window = (*window, Sample(now, round(load, 3)))
    return tuple(s for s in window if s.time > now - spec.window_seconds)


def _plural(count: int) -> str:
    return f"{count} replica" + ("" if count == 1 else "s")


def _replicas_for(spec: AutoscalingSpec, samples: tuple[Sample, ...]) -> int:
    """The replicas the samples' average load asks for (unbounded)."""
    average = sum(s.load for s in samples) / len(samples)
    return math.ceil(round(average / spec.target_in_flight_per_replica, 6))


def decide(
    spec: AutoscalingSpec, state: ScalerState, *, now: int, load: float, hold_down: bool = False
) -> Decision:
    """One pass: ``load`` is the pool's demand now; ``hold_down`` forbids scaling down."""
    window = _window(spec, state, now, load)
    average = sum(s.load for s in window) / len(window)
    wanted = _replicas_for(spec, window)
    bounded = min(max(wanted, spec.min_replicas), spec.max_replicas)
    current = state.desired
    seen = (
        f"load {average:.2f} (average over {spec.window_seconds}s) at"
        f" {spec.target_in_flight_per_replica:g} per replica asks for {_plural(wanted)}"
    )
    state = replace(state, window=window)

    def change(desired: int, reason: str, why: str) -> Decision:
        changed = replace(
            state,
            desired=desired,
            above_since=None,
            below_since=None,
            last_scale_time=now,
            last_change=reason,
        )
        return Decision(changed, current, average, reason, f"{why}: {current} -> {desired}")

    def stay(reason: str, message: str, above: int | None, below: int | None) -> Decision:
        timers = replace(state, above_since=above, below_since=below)
        return Decision(timers, current, average, reason, message)

    if current < spec.min_replicas:
        return change(spec.min_replicas, SCALED_UP, f"minReplicas is {spec.min_replicas}")
    if current > spec.max_replicas:
        return change(spec.max_replicas, SCALED_DOWN, f"maxReplicas is {spec.max_replicas}")
    if current == 0 and load > 0:
        return change(1, SCALED_FROM_ZERO, f"{load:g} requests wait for a replica")
    # The last few samples must agree with the whole window, so that a spike (or a lull)
    # shorter than the stabilization time (or the delay) restarts its clock instead of scaling.
    now_wanted = _replicas_for(spec, window[-RECENT_SAMPLES:])
    if bounded > current and now_wanted > current:
        since = state.above_since if state.above_since is not None else now
        due = since + spec.scale_up_stabilization_seconds
        if due <= now:
            return change(min(bounded, max(1, 2 * current)), SCALED_UP, seen)
        message = f"{seen}; scaling up at {_rfc3339(due)} if it holds"
        return stay(state.last_change, message, since, None)
    if bounded < current and now_wanted < current:
        since = state.below_since if state.below_since is not None else now
        if hold_down:
            message = f"{seen}; not scaling down while a rollout or drift recreation runs"
            return stay(SCALE_DOWN_HELD, message, None, since)
        last = state.last_scale_time if state.last_scale_time is not None else since
        due = max(since, last) + spec.scale_down_delay_seconds
        if due <= now:
            return change(current - 1, SCALED_DOWN, seen)
        message = f"{seen}; scaling down at {_rfc3339(due)} if it holds"
        return stay(state.last_change, message, None, since)
    if wanted > spec.max_replicas and current == spec.max_replicas:
        return stay(HELD_AT_MAX, f"{seen}; held at maxReplicas {spec.max_replicas}", None, None)
    return stay(state.last_change, seen, None, None)
