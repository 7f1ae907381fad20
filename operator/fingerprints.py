"""GET /fingerprint from every ready engine pod, concurrently and with a short timeout."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from llmpool.operator import naming
from llmpool.operator.drift import Fingerprint
from llmpool.operator.views import PodView

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 2.0


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


async def fetch_fingerprints(
    pods: Sequence[PodView],
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FingerprintReport:
    targets = checkable(pods)
    async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:

        async def fetch(pod: PodView) -> Fingerprint:
            assert pod.ip is not None
            response = await client.get(engine_url(pod.ip, "/fingerprint"))
            response.raise_for_status()
            body = response.json()
            if not isinstance(body, dict):
                raise ValueError(f"expected a JSON object, got {type(body).__name__}")
            return Fingerprint(pod=pod.name, template_digest=pod.digest, body=body)

        results = await asyncio.gather(*(fetch(p) for p in targets), return_exceptions=True)
    report = FingerprintReport(fingerprints=[])
    for pod, result in zip(targets, results, strict=True):
        if isinstance(result, Fingerprint):
            report.fingerprints.append(result)
        else:
            report.unreachable[pod.name] = f"{type(result).__name__}: {result}"
    return report
