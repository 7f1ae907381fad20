"""Per-tenant limits: token buckets for requests and tokens per minute, counters for the rest.

A request is admitted in two steps: before its body is read (concurrency, requests per minute,
and room for the prompt its Content-Length declares), then with its full estimate reserved
once the body is read; the reservation is settled against the usage the engine returns.

A tenant's counters are shared by all its keys and live as long as the gateway process: each
gateway replica enforces them on its own (no shared state), so with N replicas behind the
Service a tenant gets up to N times its limits in the worst case (``tenant_limit`` and
``gateway_replicas`` in the metrics give the effective bound).
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
    # reserved at admission (``RequestFacts.cost``), settled against the usage returned
    tokens_per_minute: int | None = None
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
        """Take ``amount`` (a negative one gives back, up to a full bucket); the level may go
        below zero when usage settles above its reservation: later requests then wait."""
        self._refill()
        self.level = min(self.per_minute, self.level - amount)


def rate_limited(message: str, kind: str, retry_after: float) -> APIError:
    """A 429 as OpenAI answers it: ``type`` says which limit, Retry-After when to try again."""
    return APIError(
        429, message, type=kind, code="rate_limit_exceeded",
        headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
    )  # fmt: skip


def _check_room(tenant: str, bucket: TokenBucket | None, amount: int, kind: str) -> None:
    if bucket is None:
        return
    if amount > bucket.per_minute:
        raise rate_limited(
            f"the request may use {amount:,} {kind} (estimated); tenant {tenant} has"
            f" {bucket.per_minute:,} {kind} per minute",
            kind, 60,
        )  # fmt: skip
    if (wait := bucket.seconds_until(amount)) > 0:
        raise rate_limited(
            f"tenant {tenant} is over its limit of {bucket.per_minute:,} {kind} per minute",
            kind, wait,
        )  # fmt: skip


@dataclass
class _Usage:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0
    held: int = 0


class Admission:
    """One admitted request: its token reservation, settled once, and its concurrency slot,
    released once (both safe to call more than once)."""

    def __init__(self, tenant: str, usage: _Usage) -> None:
        self.tenant = tenant
        self._usage = usage
        self.reserved = 0
        self.settled: int | None = None  # tokens finally counted; None: not settled yet
        self.release = once(self._release)

    def reserve(self, tokens: int) -> None:
        """Reserve the request's full estimate, or raise a 429 (``tokens`` per minute)."""
        _check_room(self.tenant, self._usage.tokens, tokens, "tokens")
        if self._usage.tokens is not None:
            self._usage.tokens.take(tokens)
        self.reserved = tokens

    def settle(self, tokens: int) -> None:
        """Count ``tokens`` instead of the reservation: the difference is given back, or taken."""
        if self.settled is not None:
            return
        self.settled = tokens
        if self._usage.tokens is not None:
            self._usage.tokens.take(tokens - self.reserved)

    def _release(self) -> None:
        self._usage.in_flight -= 1


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

    def admit(self, tenant: str, limits: TenantLimits, prompt_tokens: int) -> Admission:
        """Count one request in before its body is read, or raise a 429: its concurrency and
        its request, and room for ``prompt_tokens`` (estimated from its Content-Length)."""
        usage = self._usage_of(tenant, limits)
        if limits.max_concurrent is not None and usage.in_flight >= limits.max_concurrent:
            raise rate_limited(
                f"tenant {tenant} already has {usage.in_flight} requests in progress, its limit",
                "concurrent_requests", 1,
            )  # fmt: skip
        _check_room(tenant, usage.requests, 1, "requests")
        _check_room(tenant, usage.tokens, prompt_tokens, "tokens")
        if usage.requests is not None:
            usage.requests.take(1)
        usage.in_flight += 1
        return Admission(tenant, usage)

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
