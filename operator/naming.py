"""Names, labels and annotations shared by everything the operator creates and reads."""

from __future__ import annotations

GROUP = "llmpool.dev"
VERSION = "v1alpha1"
PLURAL = "llmpools"
KIND = "LLMPool"
DEMAND_PLURAL = "llmpooldemands"
DEMAND_KIND = "LLMPoolDemand"

FIELD_MANAGER = "llmpool-operator"

POOL_LABEL = "llmpool.dev/pool"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
ENGINE_APP = "llmpool-engine"

DIGEST_ANNOTATION = "llmpool.dev/pinned-digest"
# A short hash of the pool's engine key on the pod template: a rotated fleet key rolls the pods
# (the engine reads its key once, at start), while the key itself stays in the Secret.
ENGINE_KEY_HASH_ANNOTATION = "llmpool.dev/engine-key-hash"
# On the pod template of a pool with LoRA on: the folders its pods mount that adapters may be
# read from, as a JSON list; the operator loads an adapter only on pods that can read it.
ADAPTER_ROOTS_ANNOTATION = "llmpool.dev/adapter-roots"

ENGINE_PORT = 8000
ENGINE_PORT_NAME = "http"
CHAT_TEMPLATE_KEY = "template"
CHAT_TEMPLATE_DIR = "/etc/llmpool/chat-template"
# Where a compiling engine keeps its artifacts (--compile-cache-dir): the pool's cache volume.
COMPILE_CACHE_DIR = "/var/cache/llmpool/compile"


def selector_labels(pool: str) -> dict[str, str]:
    """Labels that select a pool's engine pods; immutable once a Deployment exists."""
    return {NAME_LABEL: ENGINE_APP, POOL_LABEL: pool}


def pod_labels(pool: str) -> dict[str, str]:
    return {**selector_labels(pool), INSTANCE_LABEL: pool, COMPONENT_LABEL: "engine"}


def object_labels(pool: str) -> dict[str, str]:
    """Labels of the Deployment, Service, ConfigMap and PodDisruptionBudget of a pool."""
    return {**pod_labels(pool), MANAGED_BY_LABEL: FIELD_MANAGER}


def selector_string(pool: str) -> str:
    """The pod selector as the scale subresource wants it (status.selector)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(pool).items()))


def deployment_name(pool: str) -> str:
    return pool


def service_name(pool: str) -> str:
    return pool


def disruption_budget_name(pool: str) -> str:
    return pool


def configmap_name(pool: str) -> str:
    return f"{pool}-engine"


def engine_key_secret_name(pool: str) -> str:
    """The Secret holding the API key the pool's engines require (``llmpool.fleet_key``)."""
    return f"{pool}-engine-key"


def demand_name(pool: str) -> str:
    """The pool's LLMPoolDemand: the gateways record in its status what they hold for the pool."""
    return pool


def endpoint(pool: str, namespace: str) -> str:
    """In-cluster OpenAI base URL of a pool."""
    return f"http://{service_name(pool)}.{namespace}.svc:{ENGINE_PORT}/v1"
