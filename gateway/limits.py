"""Per-tenant limits: token buckets for requests and tokens per minute, counters for the rest.

A tenant's counters are shared by all its keys and live as long as the gateway process: each
gateway replica enforces them on its own (no shared state), so with N replicas behind the
Service a tenant gets up to N times its limits in the worst case.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from llmpool.gateway.budget import once
from llmpool.protocol.errors import APIError


@dataclass(frozen=True)
class TenantLimits:
    """None: no limit."""

    max_concurrent: int | None = None  # requests admitted and not yet answered to the end
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # estimated at admission (``RequestFacts.cost``)
    max_held: int | None = None  # requests waiting for a pool without a ready replica


class TokenBucket:
    """``per_minute`` units refilled continuously; at most one minute's worth saved up."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self.level = float(per_minute)
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.per_minute, self.level + (now - self.stamp) * self.per_minute / 60)
        self.stamp = now

    def seconds_until(self, amount: int) -> float:
        """0 when ``amount`` can be taken now, else how long until it can."""
        self._refill()
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing * 60 / self.per_minute

    def take(self, amount: int) -> None:
        self._refill()
        self.level -= amount


def rate_limited(message: str, kind: str, retry_after: float) -> APIError:
    """A 429 as OpenAI answers it: ``type`` says which limit, Retry-After when to try again."""
    return APIError(
        429, message, type=kind, code="rate_limit_exceeded",
        headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
    )  # fmt: skip


@dataclass
class _Usage:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0
    held: int = 0


class TenantLimiter:
    """Admits a tenant's requests against its limits; changed only on the event loop's thread.

    Counters are kept per tenant and limits: a Secret whose limits change starts afresh, and
    keys of one tenant given different limits count apart (so alternating them resets nothing).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._usage: dict[tuple[str, TenantLimits], _Usage] = {}

    def _usage_of(self, tenant: str, limits: TenantLimits) -> _Usage:
        usage = self._usage.get((tenant, limits))
        if usage is None:
            usage = _Usage(
                self._bucket(limits.requests_per_minute), self._bucket(limits.tokens_per_minute)
            )
            self._usage[(tenant, limits)] = usage
        return usage

    def _bucket(self, per_minute: int | None) -> TokenBucket | None:
        return None if per_minute is None else TokenBucket(per_minute, self.clock)

    def admit(self, tenant: str, limits: TenantLimits, tokens: int) -> Callable[[], None]:
        """Count one request of ``tokens`` (estimated) in, or raise a 429; returns its release,
        which may be called more than once."""
        usage = self._usage_of(tenant, limits)
        if limits.max_concurrent is not None and usage.in_flight >= limits.max_concurrent:
            raise rate_limited(
                f"tenant {tenant} already has {usage.in_flight} requests in progress, its limit",
                "concurrent_requests", 1,
            )  # fmt: skip
        if usage.tokens is not None and tokens > usage.tokens.per_minute:
            raise rate_limited(
                f"the request may use {tokens:,} tokens (estimated); tenant {tenant} has"
                f" {usage.tokens.per_minute:,} tokens per minute",
                "tokens", 60,
            )  # fmt: skip
        for bucket, amount, kind in (
            (usage.requests, 1, "requests"),
            (usage.tokens, tokens, "tokens"),
        ):
            if bucket is not None and (wait := bucket.seconds_until(amount)) > 0:
                raise rate_limited(
                    f"tenant {tenant} is over its limit of {bucket.per_minute:,} {kind} per minute",
                    kind, wait,
                )  # fmt: skip
        for bucket, amount in ((usage.requests, 1), (usage.tokens, tokens)):
            if bucket is not None:
                bucket.take(amount)
        usage.in_flight += 1

        def release() -> None:
            usage.in_flight -= 1

        return once(release)

    @contextmanager
    def held(self, tenant: str, limits: TenantLimits) -> Iterator[None]:
        """One of the tenant's requests waits for a replica; a 429 past its ``max_held``."""
        usage = self._usage_of(tenant, limits)
        if limits.max_held is not None and usage.held >= limits.max_held:
            raise rate_limited(
                f"tenant {tenant} already has {usage.held} requests waiting for a replica,"
                " its limit",
                "held_requests", 1,
            )  # fmt: skip
        usage.held += 1
        try:
            yield
        finally:
            usage.held -= 1
