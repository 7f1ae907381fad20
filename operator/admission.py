"""Which pools the operator agrees to run: names in the grammar, engine images and node paths
its administrator allows.

The operator creates engine pods with its own RBAC from whatever a pool's author writes, so
``spec.image`` and ``file://`` sources (hostPath mounts of a node path) are checked against
operator settings first; a refused pool gets a condition and an Event, and no children. Its
names are checked as the CRD checks them (``llmpool.names``), for objects stored before the CRD
did and for what the CRD cannot say: names that differ only in case or Unicode form.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from llmpool import names
from llmpool.operator import adapters
from llmpool.operator.spec import PoolSpec

IMAGE_NOT_ALLOWED = "ImageNotAllowed"
HOST_PATH_NOT_ALLOWED = "HostPathNotAllowed"
INVALID_NAME = "InvalidName"
DEFAULT_MAX_DRIFT_RECREATIONS = 3


@dataclass(frozen=True)
class Policy:
    """The operator's settings about what pools may ask for and how their engines run
    (`llmpool operator` flags)."""

    engine_image: str
    allowed_images: tuple[str, ...]
    allow_host_path_models: bool = False
    allowed_host_path_prefixes: tuple[str, ...] = ()
    max_drift_recreations: int = DEFAULT_MAX_DRIFT_RECREATIONS
    # Every engine's --gemm-probe-patience; None: the engine's default (15 s).
    engine_gemm_probe_patience_s: float | None = None

    @classmethod
    def default(cls, engine_image: str) -> Policy:
        return cls(engine_image=engine_image, allowed_images=(image_repository(engine_image),))


@dataclass(frozen=True)
class Refusal:
    reason: str
    message: str


def image_repository(image: str) -> str:
    """``registry/name:tag`` or ``registry/name@sha256:...`` without its tag or digest."""
    name = image.split("@", 1)[0]
    head, _, tail = name.rpartition(":")
    return head if head and "/" not in tail else name


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """A prefix ending in ``/`` allows everything under it; any other is one repository, with
    any tag or digest (``ghcr.io/org/llmpool`` allows ``ghcr.io/org/llmpool:1`` but not
    ``ghcr.io/org/llmpool-other``)."""
    for prefix in prefixes:
        if prefix.endswith("/"):
            if image.startswith(prefix):
                return True
        elif image_repository(image) == prefix:
            return True
    return False


def host_path_allowed(path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``path`` (normalized, so ``..`` cannot climb out) lies under one of ``prefixes``."""
    normalized = posixpath.normpath(path)
    for prefix in prefixes:
        root = posixpath.normpath(prefix)
        if normalized == root or normalized.startswith(root.rstrip("/") + "/"):
            return True
    return False


def refusal(spec: PoolSpec, policy: Policy) -> Refusal | None:
    """Why the operator will not create this pool's pods, or None."""
    invalid = name_refusal(spec)
    if invalid is not None:
        return invalid
    own_image = spec.image is None or spec.image == policy.engine_image
    if not own_image and not image_allowed(str(spec.image), policy.allowed_images):
        allowed = ", ".join(policy.allowed_images) or "(none)"
        message = (
            f"spec.image {spec.image} is not allowed by the operator; allowed images: "
            f"{allowed} (operator flag --allowed-image, chart value allowedImages)"
        )
        return Refusal(IMAGE_NOT_ALLOWED, message)
    if spec.source.startswith("file://"):
        return _host_path_refusal(
            "spec.model.source", spec.source, spec.source.removeprefix("file://"), policy
        )
    for adapter in spec.adapters:
        root = adapters.mount_root(adapter.source)
        if adapter.source.startswith("file://") and root is not None:
            found = _host_path_refusal(
                f"spec.adapters[{adapter.name}].source", adapter.source, root, policy
            )
            if found is not None:
                return found
    return None


def name_refusal(spec: PoolSpec) -> Refusal | None:
    """A served name or adapter name outside the grammar, or two of them alike once
    normalised (the gateway could not tell them apart)."""
    fields = [("spec.model.servedName", spec.served_name)]
    fields += [(f"spec.adapters[{a.name}].name", a.name) for a in spec.adapters]
    seen: dict[str, str] = {}
    for field, name in fields:
        error = names.name_error(name, field)
        if error is not None:
            if field == "spec.model.servedName":
                error += " (when not set, it is the last path segment of spec.model.source)"
            return Refusal(INVALID_NAME, error)
        normal = names.normalize(name)
        if normal in seen:
            message = (
                f"{field} {name!r} is {seen[normal]}'s name up to case and Unicode form; clients"
                " could not tell them apart"
            )
            return Refusal(INVALID_NAME, message)
        seen[normal] = field
    return None


def _host_path_refusal(field: str, source: str, path: str, policy: Policy) -> Refusal | None:
    """Why the node path ``path`` that ``source`` mounts may not be mounted, or None."""
    if not policy.allow_host_path_models:
        message = (
            f"{field} {source} would mount a node path, and the operator does not allow "
            "hostPath models (flag --allow-host-path-models, chart value allowHostPathModels)"
        )
        return Refusal(HOST_PATH_NOT_ALLOWED, message)
    if not host_path_allowed(path, policy.allowed_host_path_prefixes):
        allowed = ", ".join(policy.allowed_host_path_prefixes)
        mounted = "" if source.endswith(path) else f" (its folder {path} is mounted)"
        message = (
            f"{field} {source} is not under an allowed host path prefix{mounted} "
            f"({allowed}; flag --allowed-host-path-prefix, chart value allowedHostPathPrefixes)"
        )
        return Refusal(HOST_PATH_NOT_ALLOWED, message)
    return None
