"""Pod volumes, materialised as plain directories under the pod's directory.

Each volume becomes ``<pod dir>/volumes/<name>/``. The container process sees it at its
``mountPath`` through a bind mount made in the container's private mount namespace (see
``launch.py``), so programs read the paths their manifest names, e.g. the service-account
token at /var/run/secrets/kubernetes.io/serviceaccount/token. ConfigMap and Secret
contents are written once, when the pod starts; later edits are not propagated.
"""

from __future__ import annotations

import base64
import shutil
from collections.abc import Callable
from pathlib import Path

from .api import Json
from .envs import ConfigError, Lookup, field_value, resource_value

# Issues a service-account token for the pod: (audience or None, expirationSeconds) -> token.
TokenIssuer = Callable[[str | None, int], str]


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


def _key_files(
    obj: Json, kind: str, items: list[Json] | None, default_mode: int
) -> list[tuple[str, bytes, int]]:
    """(relative path, content, mode) for a ConfigMap's or Secret's keys, honouring items."""
    values: dict[str, bytes] = {}
    for key, value in obj.get("data", {}).items():
        values[key] = base64.b64decode(value) if kind == "secrets" else value.encode()
    for key, value in obj.get("binaryData", {}).items():
        values[key] = base64.b64decode(value)
    if not items:
        return [(key, data, default_mode) for key, data in values.items()]
    files = []
    for item in items:
        if item["key"] not in values:
            raise ConfigError(
                f"key {item['key']!r} missing from {kind} {obj['metadata']['name']!r}"
            )
        files.append((item["path"], values[item["key"]], item.get("mode", default_mode)))
    return files


def _object_files(
    lookup: Lookup, kind: str, namespace: str, source: Json, name_field: str, default_mode: int
) -> list[tuple[str, bytes, int]]:
    obj = lookup(kind, namespace, source[name_field])
    if obj is None:
        if source.get("optional", False):
            return []
        raise ConfigError(f"{kind} {source[name_field]!r} not found")
    return _key_files(obj, kind, source.get("items"), default_mode)


def _downward_files(
    pod: Json, items: list[Json], default_mode: int
) -> list[tuple[str, bytes, int]]:
    files = []
    for item in items:
        if "fieldRef" in item:
            value = field_value(pod, item["fieldRef"]["fieldPath"])
        else:
            container = next(
                c
                for c in pod["spec"]["containers"]
                if c["name"] == item["resourceFieldRef"].get("containerName")
            )
            value = resource_value(container, item["resourceFieldRef"], {})
        files.append((item["path"], value.encode(), item.get("mode", default_mode)))
    return files


def _projected_files(
    pod: Json, source: Json, lookup: Lookup, tokens: TokenIssuer
) -> list[tuple[str, bytes, int]]:
    namespace = pod["metadata"]["namespace"]
    default_mode = source.get("defaultMode", 0o644)
    files: list[tuple[str, bytes, int]] = []
    for part in source.get("sources", []):
        if "configMap" in part:
            files += _object_files(
                lookup, "configmaps", namespace, part["configMap"], "name", default_mode
            )
        elif "secret" in part:
            files += _object_files(
                lookup, "secrets", namespace, part["secret"], "name", default_mode
            )
        elif "downwardAPI" in part:
            files += _downward_files(pod, part["downwardAPI"].get("items", []), default_mode)
        elif "serviceAccountToken" in part:
            sat = part["serviceAccountToken"]
            token = tokens(sat.get("audience"), sat.get("expirationSeconds", 3600))
            files.append(
                (sat["path"], token.encode(), 0o600 if default_mode == 0o644 else default_mode)
            )
        else:
            raise ConfigError(f"unsupported projected volume source {sorted(part)}")
    return files


def materialise(pod: Json, pod_dir: Path, lookup: Lookup, tokens: TokenIssuer) -> dict[str, Path]:
    """Write every volume of ``pod`` under ``pod_dir``; return volume name -> host path.

    Raises ConfigError while a referenced object is still missing; the caller retries.
    """
    namespace = pod["metadata"]["namespace"]
    paths: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes", []):
        name = volume["name"]
        if "hostPath" in volume:
            paths[name] = Path(volume["hostPath"]["path"])
            continue
        target = pod_dir / "volumes" / name
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            paths[name] = target
            continue
        if "configMap" in volume:
            src = volume["configMap"]
            files = _object_files(
                lookup, "configmaps", namespace, src, "name", src.get("defaultMode", 0o644)
            )
        elif "secret" in volume:
            src = volume["secret"]
            files = _object_files(
                lookup, "secrets", namespace, src, "secretName", src.get("defaultMode", 0o644)
            )
        elif "downwardAPI" in volume:
            src = volume["downwardAPI"]
            files = _downward_files(pod, src.get("items", []), src.get("defaultMode", 0o644))
        elif "projected" in volume:
            files = _projected_files(pod, volume["projected"], lookup, tokens)
        else:
            raise ConfigError(
                f"volume {name!r}: only emptyDir, hostPath, configMap, secret, downwardAPI and projected volumes are supported"
            )
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for rel, data, mode in files:
            _write(target / rel, data, mode)
        paths[name] = target
    return paths


def mounts(container: Json, volume_paths: dict[str, Path]) -> list[tuple[Path, str, bool]]:
    """(host source, mountPath, read-only) for each volumeMount of ``container``."""
    result = []
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in volume_paths:
            raise ConfigError(f"volumeMount {mount['name']!r} names no volume of the pod")
        source = volume_paths[mount["name"]]
        if mount.get("subPath"):
            source = source / mount["subPath"]
        result.append((source, mount["mountPath"], bool(mount.get("readOnly", False))))
    return result
