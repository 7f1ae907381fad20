"""kopf handlers: when a pool is reconciled, and with which of its memory; nothing decided here.

There is one reconcile path, ``converge``, level-triggered and serialized per pool: the
create/update/resume handler, the ``observe`` timer (every ``STATUS_INTERVAL_SECONDS``) and a
change of the pool's LLMPoolDemand (a gateway holding requests) all call it under the pool's
lock, and it decides only from the live LLMPool it reads under that lock, so a timer started
with an older body can never write children or status of an older spec. A pass is
observe (``observe``: the indexes, the replicas' load, the chat template, the fingerprint
check) -> plan (``plan``: pure) -> act (``act``: the API calls and Events of the plan).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import kopf

from llmpool.fleet_key import FleetKey
from llmpool.operator import admission, kube, metrics, naming
from llmpool.operator.act import Pass, act
from llmpool.operator.indexes import CHILD_WATCH_LABELS, Indexed, indexed
from llmpool.operator.observe import observe_pool
from llmpool.operator.plan import PoolObject, plan
from llmpool.operator.pool_state import PoolState

STATUS_INTERVAL_SECONDS = 2.0
DELETION_POLLING_SECONDS = 1.0
WATCH_SERVER_TIMEOUT_SECONDS = 60
WATCH_CLIENT_SLACK_SECONDS = 15
API_CONNECT_TIMEOUT_SECONDS = 5
API_REQUEST_TIMEOUT_SECONDS = 30
DEFAULT_ENGINE_IMAGE = "llmpool:latest"
ANNOTATION_PREFIX = "llmpool.dev"
POOL_STATE = "pool_state"  # the memo key of the pool's ``PoolState``


@dataclass(frozen=True)
class PoolHandle:
    """What a handler of another resource needs to run a pool's ``converge``."""

    uid: str
    memo: kopf.Memo


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Least privilege: no watching of CRDs or namespaces (namespaces are exact names).
    settings.scanning.disabled = True
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"
    # The status schema is structural: kopf's own bookkeeping goes to annotations, not status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # Events come from our own kopf.event/kopf.warn calls; kopf's per-handler chatter (a
    # timer succeeding every few seconds) stays in the log. kopf.info would be filtered too.
    settings.posting.level = logging.WARNING
    # A pool being deleted keeps its finalizer until the `observe` timer's current run ends;
    # kopf re-checks that every cancellation_polling seconds (60 by default), so a delete
    # landing mid-run would hang `kubectl delete --wait` for a minute.
    settings.background.cancellation_polling = DELETION_POLLING_SECONDS
    # Every watch ends on the server after WATCH_SERVER_TIMEOUT_SECONDS and is resumed; one
    # silently dropped (no FIN from a vanished API server) is ended by the client timeout, and
    # every other request is bounded too.
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_SECONDS
    settings.watching.client_timeout = WATCH_SERVER_TIMEOUT_SECONDS + WATCH_CLIENT_SLACK_SECONDS
    settings.watching.connect_timeout = API_CONNECT_TIMEOUT_SECONDS
    settings.networking.request_timeout = API_REQUEST_TIMEOUT_SECONDS
    settings.networking.connect_timeout = API_CONNECT_TIMEOUT_SECONDS
    # Watch only the pools' own children, filtered by the API server.
    settings.watching.label_selectors["v1", "pods"] = naming.POOL_LABEL
    settings.watching.label_selectors["apps", "v1", "deployments"] = naming.POOL_LABEL
    settings.watching.label_selectors["v1", "services"] = naming.POOL_LABEL
    settings.watching.label_selectors["v1", "configmaps"] = naming.POOL_LABEL
    settings.watching.label_selectors["v1", "secrets"] = naming.POOL_LABEL
    settings.watching.label_selectors[naming.GROUP, naming.VERSION, naming.DEMAND_PLURAL] = (
        naming.POOL_LABEL
    )
    settings.watching.label_selectors["policy", "v1", "poddisruptionbudgets"] = naming.POOL_LABEL
    kube.load_credentials()
    if memo.get("peering_to_create"):
        await kube.ensure_peering(memo["peering_to_create"], list(memo.get("namespaces") or []))
    if memo.get("metrics_port"):
        metrics.serve(memo["metrics_port"])


def _policy(memo: kopf.Memo) -> admission.Policy:
    policy = memo.get("policy")
    if isinstance(policy, admission.Policy):
        return policy
    return admission.Policy.default(memo.get("engine_image") or DEFAULT_ENGINE_IMAGE)


def _pool_lock(memo: kopf.Memo) -> asyncio.Lock:
    """The pool's reconcile lock (kopf's memo is per object and shared by its handlers)."""
    lock = memo.get("reconcile_lock")
    if lock is None:
        lock = memo["reconcile_lock"] = asyncio.Lock()
    return lock


def pool_state(memo: kopf.Memo) -> PoolState:
    state = memo.get(POOL_STATE)
    return state if isinstance(state, PoolState) else PoolState()


def replica_change(diff: kopf.Diff) -> tuple[int, int] | None:
    """``(old, new)`` when an update changed spec.replicas (e.g. `kubectl scale llmpool`)."""
    for operation, field_path, old, new in diff:
        if operation == "change" and tuple(field_path) == ("spec", "replicas"):
            return old, new
    return None


async def converge(
    *, namespace: str, name: str, uid: str, memo: kopf.Memo, indexes: Indexed
) -> None:
    """The one reconcile path: under the pool's lock, from the live pool."""
    async with _pool_lock(memo):
        live = await kube.read_pool(namespace, name)
        if live is None or live["metadata"].get("uid") != uid:
            return  # deleted (or deleted and created again: that one has its own handlers)
        if live["metadata"].get("deletionTimestamp"):
            return  # children go with the pool (owner references)
        await reconcile_pass(kopf.Body(cast(kopf.RawBody, live)), memo, indexes)


async def reconcile_pass(body: kopf.Body, memo: kopf.Memo, indexes: Indexed) -> None:
    """Observe -> plan -> act, for the pool ``body`` read under its lock."""
    pool, policy, state = PoolObject.from_body(body), _policy(memo), pool_state(memo)
    fleet = memo.get("fleet_key")
    fleet = fleet if isinstance(fleet, FleetKey) else None
    observed = await observe_pool(pool, indexes, state, policy, fleet)

    def remember(next_state: PoolState) -> None:
        memo[POOL_STATE] = next_state

    run = Pass(body, pool, observed, state, policy, remember)
    await act(run, plan(pool, observed, state, policy=policy))


@kopf.on.resume(naming.GROUP, naming.VERSION, naming.PLURAL)
@kopf.on.create(naming.GROUP, naming.VERSION, naming.PLURAL)
@kopf.on.update(naming.GROUP, naming.VERSION, naming.PLURAL)
async def reconcile(
    body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, diff: kopf.Diff, **kwargs: Any
) -> None:
    namespace, name = meta["namespace"], meta["name"]
    _register(memo, namespace, name, meta["uid"])
    pool_indexes = indexed((namespace, name), kwargs)
    await converge(namespace=namespace, name=name, uid=meta["uid"], memo=memo, indexes=pool_indexes)
    change = replica_change(diff)
    if change is not None:
        message = f"replicas {change[0]} -> {change[1]} (pods keep their template)"
        kopf.event(body, type="Normal", reason="Scaled", message=message)


@kopf.on.delete(naming.GROUP, naming.VERSION, naming.PLURAL, optional=True)
def forget(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Children go with the pool (owner references); only the metric series stay behind."""
    metrics.forget_pool(namespace or "", name)
    _pool_handles(memo).pop((namespace or "", name), None)


def _pool_handles(memo: kopf.Memo) -> dict[tuple[str, str], PoolHandle]:
    """Every pool's handle, shared by all objects' memos (``main`` puts it in the operator's
    memo, which kopf copies shallowly into each object's); a private one in unit tests."""
    handles = memo.get("pool_handles")
    if handles is None:
        handles = memo["pool_handles"] = {}
    return cast(dict[tuple[str, str], PoolHandle], handles)


def _register(memo: kopf.Memo, namespace: str, name: str, uid: str) -> None:
    _pool_handles(memo)[(namespace, name)] = PoolHandle(uid=uid, memo=memo)


@kopf.on.event(naming.GROUP, naming.VERSION, naming.DEMAND_PLURAL, labels=CHILD_WATCH_LABELS)  # type: ignore[arg-type]
async def demand_changed(
    namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **kwargs: Any
) -> None:
    """A gateway recorded held requests: converge the pool now, not at its next timer run (a
    pool at zero replicas starts scaling up at once)."""
    if namespace is None:
        return
    name = labels[naming.POOL_LABEL]
    handle = _pool_handles(memo).get((namespace, name))
    if handle is None:
        return  # the pool's own handlers have not run yet; they will converge it
    pool_indexes = indexed((namespace, name), kwargs)
    await converge(
        namespace=namespace, name=name, uid=handle.uid, memo=handle.memo, indexes=pool_indexes
    )


# kopf passes indexes as keyword arguments named after them, beyond its typed protocol.
@kopf.timer(naming.GROUP, naming.VERSION, naming.PLURAL, interval=STATUS_INTERVAL_SECONDS)  # type: ignore[arg-type]
async def observe(meta: kopf.Meta, memo: kopf.Memo, **kwargs: Any) -> None:
    namespace, name = meta["namespace"], meta["name"]
    _register(memo, namespace, name, meta["uid"])
    pool_indexes = indexed((namespace, name), kwargs)
    await converge(namespace=namespace, name=name, uid=meta["uid"], memo=memo, indexes=pool_indexes)
