"""The routing table kept in step with the API server: list, watch from there, re-list on 410.

The official client is synchronous, so each list-watch loop runs in a daemon thread of its own
and hands every change to the event loop, which alone touches the table.

Every call is bounded: a list by ``LIST_TIMEOUT``; a watch by the server, which ends it after
``WATCH_TIMEOUT_SECONDS``, and by the client's read timeout a little later, which ends a watch
whose connection died silently (no FIN: a vanished API server or a dropped NAT entry). Each
loop re-lists every ``RESYNC_SECONDS`` whatever its watch says. The table records when each
loop last heard from the API server (a list, an event, a watch the server ended), so the
gateway can tell that its table is stale (``PoolTable.age``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kubernetes
import urllib3
from kubernetes.client import ApiException

from llmpool.gateway.pools import SERVICE_NAME_LABEL, Pool, PoolTable, pool_from_object
from llmpool.gateway.tenants import API_KEY_SELECTOR, KeyRing
from llmpool.operator import naming

logger = logging.getLogger(__name__)

WATCH_TIMEOUT_SECONDS = 30  # the server ends each watch after this; the loop resumes it
WATCH_CLIENT_SLACK_SECONDS = 10  # the client gives up this much later: the watch died silently
CONNECT_TIMEOUT_SECONDS = 5.0
LIST_TIMEOUT = (CONNECT_TIMEOUT_SECONDS, 30.0)
RESYNC_SECONDS = 300  # a full re-list this often, even while the watch looks healthy
RETRY_DELAY_SECONDS = 2.0

Object = Mapping[str, Any]


@dataclass(frozen=True)
class Resource:
    """One kind of object in one namespace (None: all namespaces), and what to do with it."""

    kind: str
    namespace: str | None
    list_call: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


def resources(namespaces: Sequence[str]) -> list[Resource]:
    """LLMPools and the EndpointSlices of Services, per namespace, or cluster-wide without any."""
    custom = kubernetes.client.CustomObjectsApi()
    discovery = kubernetes.client.DiscoveryV1Api()
    slices = {"label_selector": SERVICE_NAME_LABEL}
    pool_args = (naming.GROUP, naming.VERSION)
    if not namespaces:
        return [
            Resource(
                "pools", None, custom.list_cluster_custom_object, (*pool_args, naming.PLURAL), {}
            ),
            Resource("slices", None, discovery.list_endpoint_slice_for_all_namespaces, (), slices),
        ]
    found = []
    for namespace in namespaces:
        found += [
            Resource(
                "pools",
                namespace,
                custom.list_namespaced_custom_object,
                (*pool_args, namespace, naming.PLURAL),
                {},
            ),
            Resource(
                "slices", namespace, discovery.list_namespaced_endpoint_slice, (namespace,), slices
            ),
        ]
    return found


def key_secrets(namespace: str) -> Resource:
    """The API key Secrets of one namespace (the gateway's own), by their label."""
    core = kubernetes.client.CoreV1Api()
    return Resource(
        "secrets", namespace, core.list_namespaced_secret, (namespace,),
        {"label_selector": API_KEY_SELECTOR},
    )  # fmt: skip


class TableWatcher:
    """Feeds a PoolTable (and a KeyRing, when Secrets are watched) from list-watch loops; marks
    the table synced once every first list is in, so no request is judged on half a picture."""

    def __init__(
        self, table: PoolTable, watched: Sequence[Resource], keys: KeyRing | None = None
    ) -> None:
        self.table = table
        self.watched = watched
        self.keys = keys
        self._unsynced = set(range(len(watched)))
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        """Runs until cancelled (the app's lifespan ends)."""
        self._loop = asyncio.get_running_loop()
        threads = [
            threading.Thread(target=self._list_watch, args=(i, r), daemon=True, name=r.kind)
            for i, r in enumerate(self.watched)
        ]
        for thread in threads:
            thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            self._stop.set()

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(callback, *args)

    def _list_watch(self, index: int, resource: Resource) -> None:
        while not self._stop.is_set():
            try:
                version = self._list(index, resource)
                self._watch(index, resource, version)
            except ApiException as error:
                if error.status != 410:
                    logger.warning("watching %s failed: %s", resource.kind, error)
                    self._stop.wait(RETRY_DELAY_SECONDS)
            except (urllib3.exceptions.HTTPError, OSError) as error:
                # A timeout (a watch that died silently) or a refused connection: list again.
                logger.warning("watching %s failed: %s", resource.kind, error)
                self._stop.wait(RETRY_DELAY_SECONDS)
            except Exception:
                logger.exception("watching %s failed", resource.kind)
                self._stop.wait(RETRY_DELAY_SECONDS)

    def _list(self, index: int, resource: Resource) -> str:
        response = resource.list_call(
            *resource.args, **resource.kwargs, _preload_content=False, _request_timeout=LIST_TIMEOUT
        )
        listed = json.loads(response.data)
        items = listed.get("items") or []
        self._post(self._apply_list, index, resource, items)
        return listed["metadata"]["resourceVersion"]

    def _watch(self, index: int, resource: Resource, version: str) -> None:
        """Watch from ``version`` until it is time to re-list (or a failure raises)."""
        watch = kubernetes.watch.Watch()
        resync_at = time.monotonic() + RESYNC_SECONDS
        while not self._stop.is_set() and time.monotonic() < resync_at:
            for event in watch.stream(
                resource.list_call,
                *resource.args,
                **resource.kwargs,
                resource_version=version,
                timeout_seconds=WATCH_TIMEOUT_SECONDS,
                _request_timeout=(
                    CONNECT_TIMEOUT_SECONDS,
                    WATCH_TIMEOUT_SECONDS + WATCH_CLIENT_SLACK_SECONDS,
                ),
            ):
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    self._post(
                        self._apply_event, index, resource, event["type"], event["raw_object"]
                    )
                if self._stop.is_set():
                    return
            # The server ended the watch on time: the connection was alive all along.
            self._post(self.table.heard_from, index)
            version = watch.resource_version or version

    # --- on the event loop --------------------------------------------------------------------

    def _apply_list(self, index: int, resource: Resource, items: list[Object]) -> None:
        self.table.heard_from(index)
        if resource.kind == "pools":
            self.table.reset_pools(resource.namespace, _pools(items))
        elif resource.kind == "secrets":
            assert self.keys is not None
            self.keys.reset_secrets(items)
        else:
            self.table.reset_slices(resource.namespace, items)
        self._unsynced.discard(index)
        if not self._unsynced and not self.table.synced:
            self.table.synced = True
            logger.info("watching %d pool(s)", len(self.table.pools()))

    def _apply_event(self, index: int, resource: Resource, kind: str, obj: Object) -> None:
        self.table.heard_from(index)
        metadata = obj["metadata"]
        key = (metadata["namespace"], metadata["name"])
        if resource.kind == "pools":
            if kind == "DELETED":
                self.table.delete_pool(key)
            else:
                for pool in _pools([obj]):
                    self.table.set_pool(pool)
        elif resource.kind == "secrets":
            assert self.keys is not None
            if kind == "DELETED":
                self.keys.delete_secret(metadata["name"])
            else:
                self.keys.set_secret(obj)
        elif kind == "DELETED":
            self.table.delete_slice(key)
        else:
            self.table.set_slice(obj)


def _pools(items: list[Object]) -> list[Pool]:
    pools = []
    for item in items:
        try:
            pools.append(pool_from_object(item))
        except (KeyError, TypeError) as error:
            logger.warning("skipping LLMPool %s: %r", item.get("metadata", {}).get("name"), error)
    return pools
