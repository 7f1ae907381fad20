"""The observe step of a reconcile pass: everything ``plan`` decides from, gathered once.

The indexes give the pool's pods, Deployment, children and demand records; this step adds the
time, the replicas' load (their /metrics), the user's chat template (re-read only when the pass
might apply a new pin), the pool's engine key, and, when ``plan.drift_check_due``, the
fingerprint check. The check is the one place observing acts: it brings the replicas' adapters
in line with the spec (``adapters.plan_actions``) before judging them, since what a replica
serves is only known by asking it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import httpx
import kopf

from llmpool.fleet_key import FleetKey
from llmpool.operator import adapters, admission, drift, fingerprints, kube, metrics, naming
from llmpool.operator.conditions import Event
from llmpool.operator.indexes import Indexed
from llmpool.operator.plan import (
    DriftCheck,
    Observed,
    PoolObject,
    adapter_retry_due,
    drift_check_due,
    rejected_again,
    rendered_pin,
)
from llmpool.operator.pool_load import replica_loads
from llmpool.operator.pool_state import PoolState
from llmpool.operator.spec import PoolSpec
from llmpool.operator.views import PodView, owned_pods

logger = logging.getLogger(__name__)

APPLY_RETRY_SECONDS = 10


class ChatTemplateMissing(Exception):
    pass


async def observe_pool(
    pool: PoolObject,
    indexed: Indexed,
    state: PoolState,
    policy: admission.Policy,
    fleet: FleetKey | None,
) -> Observed:
    pods = owned_pods(indexed.pods, naming.deployment_name(pool.name))
    loads = await replica_loads(pods)
    observed = Observed(
        pods=pods,
        deployment=indexed.deployment,
        wall=time.time(),
        monotonic=time.monotonic(),
        children=indexed.children,
        demand=indexed.demand,
        served_name_claims=indexed.served_name_claims,
        loads=loads,
    )
    if admission.refusal(pool.spec, policy) is not None:
        return observed  # nothing is rendered, nothing checked
    check_due = drift_check_due(pool, pods, state, observed.monotonic)
    fresh = check_due or not pool.reconciled
    try:
        template = await read_chat_template(pool.spec, pool.namespace, state, fresh)
    except ChatTemplateMissing as error:
        observed = replace(observed, template_missing=str(error))
    else:
        observed = replace(observed, chat_template=template)
    if observed.template_missing is None or (check_due and pool.spec.lora_settings is not None):
        observed = replace(observed, engine_key=engine_key(fleet, pool.namespace, pool.name))
    pinned, digest = rendered_pin(pool, observed)
    if check_due and digest is not None and rejected_again(pool, state, digest) is None:
        check = await check_drift(pool, observed, pinned, digest, state)
        observed = replace(observed, drift=check)
    return observed


async def read_chat_template(
    pool: PoolSpec, namespace: str, state: PoolState, fresh: bool
) -> str | None:
    """The user's template; re-read only when ``fresh`` (else the last one read, if any)."""
    ref = pool.chat_template
    if ref is None:
        return None
    cached = state.chat_template
    if not fresh and cached is not None and cached[0] == ref:
        return cached[1]
    template = await kube.read_configmap_key(namespace, ref.name, ref.key)
    if template is None:
        raise ChatTemplateMissing(
            f"chat template ConfigMap {namespace}/{ref.name} with key {ref.key!r} not found"
        )
    return template


def engine_key(fleet: FleetKey | None, namespace: str, name: str) -> str | None:
    """The pool's engine key from the fleet key; None in open mode (no fleet key configured)."""
    if fleet is None:
        return None
    try:
        return fleet.engine_key(namespace, name)
    except (OSError, ValueError) as error:
        raise kopf.TemporaryError(
            f"reading the fleet key: {error}", delay=APPLY_RETRY_SECONDS
        ) from error


async def check_drift(
    pool: PoolObject,
    observed: Observed,
    pinned: Mapping[str, object],
    digest: str,
    state: PoolState,
) -> DriftCheck:
    """Fingerprint the ready pods, bring their adapters in line with the spec, and judge them."""
    namespace, name = pool.namespace, pool.name
    report = await fingerprints.fetch_fingerprints(observed.pods)
    for pod, why in report.unreachable.items():
        # Logged, not an Event: a pod on its way down would raise one every interval.
        metrics.FINGERPRINT_ERRORS.labels(namespace, name).inc()
        logger.warning("%s/%s: GET /fingerprint of pod %s failed: %s", namespace, name, pod, why)
    found = report.fingerprints
    entries = drift.classify_drift(found, pinned, digest)
    check = DriftCheck(entries, len(found), adapters.adapter_status(pool.spec.adapters, found))
    if pool.spec.lora_settings is None:
        return check
    retry = adapter_retry_due(state, pool.spec, observed.monotonic)
    found, adapted = await converge_adapters(
        pool.spec, observed.pods, found, digest, observed.engine_key, retry_failed=retry
    )
    return DriftCheck(
        entries=sorted([*entries, *adapted.entries], key=lambda e: (e.pod, e.field)),
        checked=len(found),
        adapters=adapters.adapter_status(pool.spec.adapters, found),
        adapter_events=adapted.events,
        retried=retry,
        recheck=adapted.all_ok,
    )


@dataclass(frozen=True)
class AdapterActions:
    """What ``converge_adapters`` did: the adapter drift after it, the Events its outcomes
    raise, and whether there were actions and every one succeeded."""

    entries: list[drift.DriftEntry]
    events: list[Event]
    all_ok: bool


async def converge_adapters(
    spec: PoolSpec,
    pods: Sequence[PodView],
    found: list[drift.Fingerprint],
    digest: str,
    key: str | None,
    *,
    retry_failed: bool,
) -> tuple[list[drift.Fingerprint], AdapterActions]:
    """POST the planned loads, reloads and unloads (unloads first, to free slots; each group
    concurrently), fingerprint the pods acted on again, and judge the adapters from that.

    When every action succeeded the next pass checks again at once, so that reloads held back
    by ``rollout.maxUnavailable`` follow without waiting for the drift interval."""
    current = adapters.replicas(found, pods, digest)
    actions = adapters.plan_actions(
        spec.adapters,
        current,
        max_reloading_pods=spec.max_unavailable,
        retry_failed=retry_failed,
    )
    if not actions:
        entries = adapters.classify_adapter_drift(spec.adapters, current)
        return found, AdapterActions(entries, [], all_ok=False)
    by_name = {p.name: p for p in pods}

    async def post(action: adapters.Action) -> adapters.Outcome:
        try:
            response = await fingerprints.post_to_pod(
                by_name[action.pod], action.path, action.body, key
            )
        except (httpx.HTTPError, ValueError) as error:
            return adapters.Outcome(action, None, f"{type(error).__name__}: {error}")
        return adapters.Outcome.of(action, response.status_code, response.text)

    outcomes: list[adapters.Outcome] = []
    for group in adapters.in_order(actions):
        outcomes += await asyncio.gather(*(post(action) for action in group))
    acted = sorted({a.pod for a in actions})
    again = await fingerprints.fetch_fingerprints([by_name[pod] for pod in acted])
    fresh = {f.pod: f for f in again.fingerprints}
    found = [fresh.get(f.pod, f) for f in found]
    after = adapters.replicas(found, pods, digest)
    events = adapters.action_events(outcomes, before=current, after=after)
    entries = adapters.classify_adapter_drift(spec.adapters, after)
    return found, AdapterActions(entries, events, all(outcome.ok for outcome in outcomes))
