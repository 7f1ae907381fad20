"""The objects a pool owns (ConfigMap, engine-key Secret, Service, PodDisruptionBudget, Deployment,
LLMPoolDemand), rendered as pure functions of its spec.

Owner references and the namespace are added by the handler (``kopf.adopt``); everything else
that reaches the API server is decided here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import posixpath
from typing import Any

from llmpool import fleet_key, pinning
from llmpool.operator import adapters, naming
from llmpool.operator.engine_args import engine_args, quantity_bytes
from llmpool.operator.sizing import default_memory_limit
from llmpool.operator.spec import PoolSpec

ENGINE_USER_ID = 10001
PINNED_JSON_KEY = "pinned.json"
# A stopped pod keeps serving this long before SIGTERM, while its endpoint's removal reaches
# kube-proxy and the gateways (the kubelet's own sleep: the image needs no shell).
PRESTOP_SLEEP_SECONDS = 5
# After the drain (--shutdown-timeout): the last responses written, the engine thread joined.
EXIT_MARGIN_SECONDS = 15
ENGINE_KEY_HASH_CHARS = 16


def render_configmap(pool: str, pinned: dict[str, Any], chat_template: str | None) -> dict:
    """The pool's own ConfigMap: the pinned fields, and the exact chat template pods mount.

    The template is a copy of the user's ConfigMap, so that the sha256 in the pinned digest is
    of exactly the bytes every replica reads, even if the user's ConfigMap changes later.
    """
    data = {PINNED_JSON_KEY: pinning.canonical_json(pinned)}
    if chat_template is not None:
        data[naming.CHAT_TEMPLATE_KEY] = chat_template
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": naming.configmap_name(pool), "labels": naming.object_labels(pool)},
        "data": data,
    }


def render_engine_key_secret(pool: str, engine_key: str) -> dict:
    """The key the pool's engines require on /v1 routes (``llmpool.fleet_key.pool_engine_key``)."""
    encoded = base64.b64encode(engine_key.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": naming.engine_key_secret_name(pool),
            "labels": naming.object_labels(pool),
        },
        "type": "Opaque",
        "data": {fleet_key.ENGINE_KEY_FIELD: encoded},
    }


def engine_key_hash(engine_key: str) -> str:
    """A short hash of the key for the pod template: it changes with the key, and tells nothing
    of it (the key is an HMAC output; a 64-bit prefix of its sha256 cannot be inverted)."""
    return hashlib.sha256(engine_key.encode()).hexdigest()[:ENGINE_KEY_HASH_CHARS]


def render_demand(pool: str) -> dict:
    """The pool's LLMPoolDemand: no spec; gateways write what they hold in its status."""
    return {
        "apiVersion": f"{naming.GROUP}/{naming.VERSION}",
        "kind": naming.DEMAND_KIND,
        "metadata": {"name": naming.demand_name(pool), "labels": naming.object_labels(pool)},
    }


def render_service(pool: str) -> dict:
    """A ClusterIP Service in front of the ready engine pods: the pool's OpenAI endpoint."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": naming.service_name(pool), "labels": naming.object_labels(pool)},
        "spec": {
            "type": "ClusterIP",
            "selector": naming.selector_labels(pool),
            "ports": [
                {
                    "name": naming.ENGINE_PORT_NAME,
                    "port": naming.ENGINE_PORT,
                    "targetPort": naming.ENGINE_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def render_disruption_budget(pool: str, spec: PoolSpec) -> dict:
    """At most ``rollout.maxUnavailable`` of the pool's pods evicted at once (a node drain, the
    Eviction API): the same bound as a rollout's. A pod that is not Ready may always be evicted,
    so a crash-looping replica never blocks a drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": naming.disruption_budget_name(pool),
            "labels": naming.object_labels(pool),
        },
        "spec": {
            "maxUnavailable": spec.max_unavailable,
            "selector": {"matchLabels": naming.selector_labels(pool)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _model_volumes(source: str) -> tuple[list[dict], list[dict]]:
    """Volumes and mounts that make a model source readable inside the engine container.

    hf:// models are read from the Hugging Face cache the image provides at HF_CACHE_ROOT.
    """
    if source.startswith("pvc://"):
        claim = source.removeprefix("pvc://").split("/", 1)[0]
        mount_path = f"{pinning.PVC_MOUNT_ROOT}/{claim}"
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return [volume], [{"name": "model", "mountPath": mount_path, "readOnly": True}]
    if source.startswith("file://"):
        path = source.removeprefix("file://")
        volume = {"name": "model", "hostPath": {"path": path}}
        return [volume], [{"name": "model", "mountPath": path, "readOnly": True}]
    return [], []


def _compile_cache_source(spec: PoolSpec) -> dict:
    """``engine.compileCache``, else an emptyDir: a restarted container starts from its
    artifacts, and a claim shared by the replicas lets each new one start from them too."""
    return dict(spec.engine.compile_cache or {"emptyDir": {}})


def _adapter_volume_source(source: str, root: str) -> dict:
    if source.startswith("pvc://"):
        claim = source.removeprefix("pvc://").split("/", 1)[0]
        return {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return {"hostPath": {"path": root}}


def _adapter_volumes(spec: PoolSpec) -> tuple[list[dict], list[dict], list[str]]:
    """Volumes and mounts for the adapters' folders, and every root the pods can read adapters
    from (the model's mount included).

    One volume per distinct root, none for a root inside another mounted one, named after its
    path and listed in path order: adding an adapter under a mounted root leaves the pod
    template as it is, so the running pods load it without a restart.
    """
    roots = [mount["mountPath"] for mount in _model_volumes(spec.source)[1]]
    wanted = {
        root: _adapter_volume_source(a.source, root)
        for a in spec.adapters
        if (root := adapters.mount_root(a.source)) is not None
    }
    added: dict[str, dict] = {}
    for root in sorted(wanted, key=lambda r: (posixpath.normpath(r).count("/"), r)):
        if not any(adapters.under(root, mounted) for mounted in roots):
            roots.append(root)
            added[root] = wanted[root]
    volumes, mounts = [], []
    for root in sorted(added):
        name = "adapters-" + hashlib.sha256(root.encode()).hexdigest()[:12]
        volumes.append({"name": name, **added[root]})
        mounts.append({"name": name, "mountPath": root, "readOnly": True})
    return volumes, mounts, sorted(roots)


def _engine_container(spec: PoolSpec, image: str, gemm_probe_patience_s: float | None) -> dict:
    port = naming.ENGINE_PORT_NAME
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.image or image,
        # The image's ENTRYPOINT is the `llmpool` console script (the same image runs the
        # operator), so only the subcommand and its arguments are given.
        "args": ["serve", *engine_args(spec, gemm_probe_patience_s)],
        "ports": [{"name": port, "containerPort": naming.ENGINE_PORT, "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        # Loading (and on first use converting) a model takes a while: liveness starts only
        # once /health answered, and the process then has 5 minutes to come up.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 60,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_USER_ID,
            "runAsGroup": ENGINE_USER_ID,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        # The engine writes "RevisionMismatch: ..." here before exiting with code 3.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    resources = engine_resources(spec)
    if resources:
        container["resources"] = resources
    return container


def engine_resources(spec: PoolSpec) -> dict[str, Any]:
    """The spec's resources, with a default memory limit (``sizing.default_memory_limit``) when
    the spec sets none: never below the spec's memory request, which a limit may not undercut."""
    resources = {key: dict(value) for key, value in spec.resources.items()}
    limits = resources.get("limits") or {}
    default = default_memory_limit(spec)
    if "memory" in limits or default is None:
        return resources
    request = (resources.get("requests") or {}).get("memory")
    if request is not None and quantity_bytes(request) > quantity_bytes(default):
        default = request
    resources["limits"] = {**limits, "memory": default}
    return resources


def termination_grace_seconds(spec: PoolSpec) -> int:
    """Longer than the preStop sleep and the engine's drain together, so that SIGKILL never
    comes before the engine has finished or ended its requests."""
    return PRESTOP_SLEEP_SECONDS + spec.drain_seconds + EXIT_MARGIN_SECONDS


def render_deployment(
    pool: str,
    spec: PoolSpec,
    digest: str,
    image: str,
    replicas: int | None = None,
    engine_key: str | None = None,
    gemm_probe_patience_s: float | None = None,
) -> dict:
    """The engine Deployment; ``image`` is used when the spec names none, ``replicas`` (the
    autoscaler's count) when given, else ``spec.replicas``; with an ``engine_key`` (not in open
    mode) the engine reads it from the pool's Secret as ``LLMPOOL_API_KEY``;
    ``gemm_probe_patience_s`` is the operator's ``--engine-gemm-probe-patience``.

    The pod template depends on the spec's engine settings, ``digest``, the key's hash and the
    operator's engine settings only, never on ``replicas``, so scaling does not roll the pods
    while any pinned change does.
    """
    container = _engine_container(spec, image, gemm_probe_patience_s)
    template_annotations = {naming.DIGEST_ANNOTATION: digest}
    if engine_key is not None:
        secret = naming.engine_key_secret_name(pool)
        container["env"] = [
            {
                "name": fleet_key.ENGINE_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": secret, "key": fleet_key.ENGINE_KEY_FIELD}},
            }
        ]
        template_annotations[naming.ENGINE_KEY_HASH_ANNOTATION] = engine_key_hash(engine_key)
    volumes: list[dict] = [{"name": "tmp", "emptyDir": {}}]
    if spec.chat_template is not None:
        volumes.append(
            {
                "name": "chat-template",
                "configMap": {
                    "name": naming.configmap_name(pool),
                    "items": [{"key": naming.CHAT_TEMPLATE_KEY, "path": naming.CHAT_TEMPLATE_KEY}],
                },
            }
        )
        container["volumeMounts"].append(
            {"name": "chat-template", "mountPath": naming.CHAT_TEMPLATE_DIR, "readOnly": True}
        )
    if spec.engine.compile:
        volumes.append({"name": "compile-cache", **_compile_cache_source(spec)})
        container["volumeMounts"].append(
            {"name": "compile-cache", "mountPath": naming.COMPILE_CACHE_DIR}
        )
    model_volumes, model_mounts = _model_volumes(spec.source)
    volumes += model_volumes
    container["volumeMounts"] += model_mounts
    if spec.lora_settings is not None:
        adapter_volumes, adapter_mounts, roots = _adapter_volumes(spec)
        volumes += adapter_volumes
        container["volumeMounts"] += adapter_mounts
        template_annotations[naming.ADAPTER_ROOTS_ANNOTATION] = json.dumps(roots)

    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_USER_ID,
            "runAsGroup": ENGINE_USER_ID,
            "fsGroup": ENGINE_USER_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(toleration) for toleration in spec.tolerations]

    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": naming.deployment_name(pool),
            "labels": naming.object_labels(pool),
            "annotations": {naming.DIGEST_ANNOTATION: digest},
        },
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "selector": {"matchLabels": naming.selector_labels(pool)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxUnavailable": spec.max_unavailable,
                    "maxSurge": spec.max_surge,
                },
            },
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": naming.pod_labels(pool),
                    "annotations": template_annotations,
                },
                "spec": pod_spec,
            },
        },
    }
