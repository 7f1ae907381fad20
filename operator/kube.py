"""The operator's own Kubernetes API calls (kopf does the watching, events and pool patches).

The official client is synchronous; every call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, cast

import kubernetes
from kubernetes.client import ApiException

from llmpool.operator import naming

logger = logging.getLogger(__name__)

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_PATCH_CONTENT_TYPE = "application/merge-patch+json"
# Every call is bounded (connect, read), so an API server that stops answering fails the pass
# (which kopf retries) instead of hanging it, and with it the pool's lock, for good.
REQUEST_TIMEOUT = (5.0, 30.0)


def load_credentials() -> None:
    """In-cluster service account, else the local kubeconfig."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def _demand_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """A CustomObjectsApi call on LLMPoolDemands with the core APIs' (name, namespace, ...) order."""

    def call(name: str, namespace: str, *args: Any, **kwargs: Any) -> Any:
        return method(
            naming.GROUP, naming.VERSION, namespace, naming.DEMAND_PLURAL, name, *args, **kwargs
        )

    return call


# The client of each child kind, and the kind's name in that client's method names.
_CHILD_APIS: dict[str, tuple[Callable[[], Any], str]] = {
    "ConfigMap": (kubernetes.client.CoreV1Api, "namespaced_config_map"),
    "Secret": (kubernetes.client.CoreV1Api, "namespaced_secret"),
    "Service": (kubernetes.client.CoreV1Api, "namespaced_service"),
    "PodDisruptionBudget": (kubernetes.client.PolicyV1Api, "namespaced_pod_disruption_budget"),
    "Deployment": (kubernetes.client.AppsV1Api, "namespaced_deployment"),
}
# An LLMPoolDemand's calls, by verb, on CustomObjectsApi.
_DEMAND_METHODS = {
    "patch": "patch_namespaced_custom_object",
    "read": "get_namespaced_custom_object",
}


def _child_call(kind: str, verb: str) -> Callable[..., Any]:
    """``verb`` ("patch" or "read") of a child of ``kind``, called as (name, namespace, ...)."""
    if kind == naming.DEMAND_KIND:
        custom = kubernetes.client.CustomObjectsApi()
        return _demand_call(getattr(custom, _DEMAND_METHODS[verb]))
    api, resource = _CHILD_APIS[kind]
    return cast(Callable[..., Any], getattr(api(), f"{verb}_{resource}"))


async def apply(obj: dict[str, Any]) -> None:
    """Server-side apply: idempotent, and restarting mid-way cannot create duplicates.

    Forced, because the fields are the operator's own; that it applies only objects it
    controls is checked before (``ownership.conflicts``)."""
    patch = _child_call(obj["kind"], "patch")
    metadata = obj["metadata"]
    await asyncio.to_thread(
        patch,
        metadata["name"],
        metadata["namespace"],
        obj,
        field_manager=naming.FIELD_MANAGER,
        force=True,
        _content_type=APPLY_CONTENT_TYPE,
        _request_timeout=REQUEST_TIMEOUT,
    )


async def read_metadata(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The metadata of an object of a child's kind and name, or None when there is none."""
    read = _child_call(kind, "read")
    try:
        found = await asyncio.to_thread(read, name, namespace, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    body = kubernetes.client.ApiClient().sanitize_for_serialization(found)
    return cast(dict[str, Any], body.get("metadata") or {})


def error_message(error: ApiException) -> str:
    """The API server's own explanation (the Status object's message), else the HTTP reason."""
    try:
        status = json.loads(error.body or "")
    except (TypeError, ValueError):
        status = None
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return f"{error.status} {error.reason}"


async def read_pool(namespace: str, name: str) -> dict[str, Any] | None:
    """The live LLMPool (None once it is gone): every reconcile decides from this, never from
    the possibly older body a kopf handler or timer was started with."""
    custom = kubernetes.client.CustomObjectsApi()
    try:
        pool = await asyncio.to_thread(
            custom.get_namespaced_custom_object,
            naming.GROUP,
            naming.VERSION,
            namespace,
            naming.PLURAL,
            name,
            _request_timeout=REQUEST_TIMEOUT,
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return cast(dict[str, Any], pool)


async def _merge_patch_pool(
    patch: Callable[..., Any], namespace: str, name: str, body: dict[str, Any]
) -> None:
    await asyncio.to_thread(
        patch,
        naming.GROUP,
        naming.VERSION,
        namespace,
        naming.PLURAL,
        name,
        body,
        _content_type=MERGE_PATCH_CONTENT_TYPE,
        _request_timeout=REQUEST_TIMEOUT,
    )


async def patch_pool_status(namespace: str, name: str, patch: dict[str, Any]) -> None:
    """JSON merge patch of the status subresource."""
    custom = kubernetes.client.CustomObjectsApi()
    await _merge_patch_pool(
        custom.patch_namespaced_custom_object_status, namespace, name, {"status": patch}
    )


async def patch_demand_status(namespace: str, name: str, patch: dict[str, Any]) -> None:
    """JSON merge patch of an LLMPoolDemand's status: a gateway's record of what it holds, or
    the operator pruning records of gateways long gone."""
    custom = kubernetes.client.CustomObjectsApi()
    await asyncio.to_thread(
        _demand_call(custom.patch_namespaced_custom_object_status),
        name,
        namespace,
        {"status": patch},
        _content_type=MERGE_PATCH_CONTENT_TYPE,
        _request_timeout=REQUEST_TIMEOUT,
    )


async def read_configmap_key(namespace: str, name: str, key: str) -> str | None:
    """A ConfigMap value, or None when the ConfigMap or the key does not exist."""
    core = kubernetes.client.CoreV1Api()
    try:
        configmap = await asyncio.to_thread(
            core.read_namespaced_config_map, name, namespace, _request_timeout=REQUEST_TIMEOUT
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return (configmap.data or {}).get(key)


async def annotate_pod(namespace: str, name: str, annotations: dict[str, str]) -> None:
    """JSON merge patch of a pod's annotations; a pod already gone is no error."""
    core = kubernetes.client.CoreV1Api()
    body = {"metadata": {"annotations": annotations}}
    try:
        await asyncio.to_thread(
            core.patch_namespaced_pod,
            name,
            namespace,
            body,
            _content_type=MERGE_PATCH_CONTENT_TYPE,
            _request_timeout=REQUEST_TIMEOUT,
        )
    except ApiException as error:
        if error.status != 404:
            raise


async def delete_pod(namespace: str, name: str, uid: str) -> bool:
    """Delete exactly the pod that was judged (uid precondition); False if it is already gone."""
    core = kubernetes.client.CoreV1Api()
    options = kubernetes.client.V1DeleteOptions(
        preconditions=kubernetes.client.V1Preconditions(uid=uid)
    )
    try:
        await asyncio.to_thread(
            core.delete_namespaced_pod,
            name,
            namespace,
            body=options,
            _request_timeout=REQUEST_TIMEOUT,
        )
    except ApiException as error:
        if error.status in (404, 409):
            return False
        raise
    return True


async def ensure_peering(name: str, namespaces: list[str]) -> None:
    """Create the kopf peering object(s) if missing: kopf only patches existing ones.

    Cluster-wide (no ``namespaces``) uses a ClusterKopfPeering, otherwise a KopfPeering per
    namespace. A missing peering CRD is logged, not fatal: the operator then runs alone.
    """
    custom = kubernetes.client.CustomObjectsApi()
    body = {"apiVersion": "kopf.dev/v1", "metadata": {"name": name}}
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]
    if namespaces:
        kind = {**body, "kind": "KopfPeering"}
        calls = [
            (custom.create_namespaced_custom_object, ("kopf.dev", "v1", ns, "kopfpeerings", kind))
            for ns in namespaces
        ]
    else:
        kind = {**body, "kind": "ClusterKopfPeering"}
        calls = [
            (custom.create_cluster_custom_object, ("kopf.dev", "v1", "clusterkopfpeerings", kind))
        ]
    for call, args in calls:
        try:
            await asyncio.to_thread(call, *args, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as error:
            if error.status == 404:
                logger.warning("kopf peering CRDs are not installed (crds/kopf-peering.yaml)")
            elif error.status != 409:
                raise
