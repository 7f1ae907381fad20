"""Whether a pool's children (ConfigMap, Secret, Service, Deployment, ...) still hold what the
operator renders.

The comparison is kubectl-apply-like: only the fields the operator renders are compared, so
what the API server defaults or another manager adds never counts as a difference, while a
deleted child, an edited argument or a changed label does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from llmpool.operator import naming

# Only these parts of a live child are kept in the operator's indexes and compared.
KEPT_METADATA = ("name", "namespace", "labels", "annotations", "ownerReferences")
KEPT_TOP_LEVEL = ("spec", "data")
MAX_LISTED_PATHS = 5


@dataclass(frozen=True)
class ChildView:
    """The comparable part of a live child, as the operator's indexes keep it."""

    kind: str
    name: str
    body: Mapping[str, Any]


def child_view(body: Mapping[str, Any]) -> ChildView:
    metadata = body.get("metadata") or {}
    kept: dict[str, Any] = {
        "metadata": {key: metadata[key] for key in KEPT_METADATA if key in metadata}
    }
    kept.update({key: body[key] for key in KEPT_TOP_LEVEL if key in body})
    return ChildView(kind=body.get("kind", ""), name=metadata.get("name", ""), body=kept)


def _same_scalar(desired: Any, live: Any, path: str) -> bool:
    if desired == live:
        return True
    # The API server canonicalizes resource quantities (4 -> "4", "1.5Gi" -> "1536Mi").
    if ".resources." in path and isinstance(desired, int | str) and isinstance(live, int | str):
        try:
            return bool(parse_quantity(desired) == parse_quantity(live))
        except ValueError:
            return False
    return False


def differences(desired: Any, live: Any, path: str = "") -> list[str]:
    """Paths of the rendered fields whose live value differs (a list must match in length)."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return [path or "."]
        found: list[str] = []
        for key, value in desired.items():
            child_path = f"{path}.{key}"
            if key not in live:
                found.append(child_path)
            else:
                found += differences(value, live[key], child_path)
        return found
    if isinstance(desired, Sequence) and not isinstance(desired, str):
        if not isinstance(live, Sequence) or isinstance(live, str) or len(live) != len(desired):
            return [path]
        found = []
        for index, (want, have) in enumerate(zip(desired, live, strict=True)):
            found += differences(want, have, f"{path}[{index}]")
        return found
    return [] if _same_scalar(desired, live, path) else [path]


def drift_message(kind: str, name: str, live: ChildView | None, desired: Mapping[str, Any]) -> str:
    """Why a child is re-applied ("" when it holds what is rendered)."""
    if live is None:
        return f"{kind} {name} was missing"
    paths = differences(child_view(desired).body, live.body)
    if not paths:
        return ""
    shown = ", ".join(paths[:MAX_LISTED_PATHS])
    more = len(paths) - MAX_LISTED_PATHS
    return f"{kind} {name} differed at {shown}" + (f" and {more} more" if more > 0 else "")


def _engine_key_hash(deployment: Mapping[str, Any]) -> str | None:
    template = (deployment.get("spec") or {}).get("template") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    return annotations.get(naming.ENGINE_KEY_HASH_ANNOTATION)


def engine_key_changed(live: ChildView | None, desired: Mapping[str, Any]) -> bool:
    """Whether the live Deployment's pods were rendered for another engine key than ``desired``
    (the fleet key rotated, or was set or removed): a planned roll, not a restore."""
    return live is not None and _engine_key_hash(live.body) != _engine_key_hash(desired)
