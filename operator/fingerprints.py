"""GET /fingerprint (or another path) from every ready engine pod, concurrently, briefly; and
POST to one pod's API (adapter loads) with the pool's engine key."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from llmpool.operator import naming
from llmpool.operator.drift import Fingerprint
from llmpool.operator.views import PodView

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIMEOUT_SECONDS = 2.0
# An adapter load reads and hashes the adapter's files before it answers.
POST_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class FingerprintReport:
    fingerprints: list[Fingerprint]
    unreachable: dict[str, str] = field(default_factory=dict)  # pod -> why


def engine_url(ip: str, path: str) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{naming.ENGINE_PORT}{path}"


def checkable(pods: Sequence[PodView]) -> list[PodView]:
    """Pods that can answer: ready, with an IP, and not on their way out."""
    return [p for p in pods if p.ready and p.ip and not p.terminating]


async def fetch_from_pods(
    pods: Sequence[PodView],
    path: str,
    parse: Callable[[PodView, httpx.Response], T],
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[dict[str, T], dict[str, str]]:
    """GET ``path`` from every checkable pod at once: what ``parse`` made of each answer, and
    why each other pod failed, by pod name."""
    targets = checkable(pods)
    async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:

        async def fetch(pod: PodView) -> T:
            assert pod.ip is not None
            response = await client.get(engine_url(pod.ip, path))
            response.raise_for_status()
            return parse(pod, response)

        results = await asyncio.gather(*(fetch(p) for p in targets), return_exceptions=True)
    answered: dict[str, T] = {}
    failed: dict[str, str] = {}
    for pod, result in zip(targets, results, strict=True):
        if isinstance(result, BaseException):
            failed[pod.name] = f"{type(result).__name__}: {result}"
        else:
            answered[pod.name] = result
    return answered, failed


def _fingerprint(pod: PodView, response: httpx.Response) -> Fingerprint:
    body = response.json()
    if not isinstance(body, dict):
        raise ValueError(f"expected a JSON object, got {type(body).__name__}")
    return Fingerprint(pod=pod.name, template_digest=pod.digest, body=body)


async def fetch_fingerprints(
    pods: Sequence[PodView],
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FingerprintReport:
    answered, failed = await fetch_from_pods(
        pods, "/fingerprint", _fingerprint, timeout=timeout, transport=transport
    )
    return FingerprintReport(fingerprints=list(answered.values()), unreachable=failed)


async def post_to_pod(
    pod: PodView,
    path: str,
    body: Mapping[str, Any],
    engine_key: str | None,
    *,
    timeout: float = POST_TIMEOUT_SECONDS,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.Response:
    """POST ``body`` as JSON to ``path`` of ``pod`` (an ``/v1`` route: behind the pool's engine
    key unless the pool is open). Any answer is returned; a transport failure raises."""
    if pod.ip is None:
        raise ValueError(f"pod {pod.name} has no IP")
    headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
    async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:
        return await client.post(engine_url(pod.ip, path), json=dict(body), headers=headers)
