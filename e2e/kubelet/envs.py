"""Container environment: env, envFrom, valueFrom and Kubernetes' $(VAR) expansion."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable, Mapping
from decimal import ROUND_CEILING, Decimal

from .api import Json

# Fetches a ConfigMap or Secret: (kind, namespace, name) -> object, or None if it is absent.
Lookup = Callable[[str, str, str], Json | None]

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ConfigError(RuntimeError):
    """The container's configuration cannot be resolved (CreateContainerConfigError)."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes expansion: $(VAR) -> value when VAR is defined, $$ -> $, else untouched."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR.sub(sub, text)


_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": Decimal("0.001"),
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # fmt: skip


def parse_quantity(q: str) -> Decimal:
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if q.endswith(suffix):
            return Decimal(q[: -len(suffix)]) * Decimal(_SUFFIXES[suffix])
    return Decimal(q)


def field_value(pod: Json, path: str) -> str:
    """The value of a downward-API fieldRef ``path`` for ``pod``."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    mapped = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if mapped:
        return meta.get(mapped.group(1), {}).get(mapped.group(2), "")
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIP": status.get("podIP", ""),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs", [])),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs", [])),
    }
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef {path!r}")
    return simple[path]


def resource_value(container: Json, ref: Json, node_allocatable: Mapping[str, str]) -> str:
    """A resourceFieldRef: the container's limit (node allocatable when unset) or request."""
    kind, resource = ref["resource"].split(".", 1)
    resources = container.get("resources", {})
    raw = resources.get(kind, {}).get(resource)
    if raw is None and kind == "requests":
        raw = resources.get("limits", {}).get(resource)
    if raw is None:
        raw = node_allocatable.get(resource, "0")
    divisor = parse_quantity(str(ref.get("divisor", "1")))
    return str((parse_quantity(str(raw)) / divisor).to_integral_value(rounding=ROUND_CEILING))


def _key_of(lookup: Lookup, kind: str, namespace: str, ref: Json) -> str | None:
    obj = lookup(kind, namespace, ref["name"])
    optional = ref.get("optional", False)
    if obj is None:
        if optional:
            return None
        raise ConfigError(f"{kind} {ref['name']!r} not found")
    if kind == "configmaps":
        data = obj.get("data", {})
        if ref["key"] in data:
            return data[ref["key"]]
        binary = obj.get("binaryData", {})
        if ref["key"] in binary:
            return base64.b64decode(binary[ref["key"]]).decode()
    elif ref["key"] in obj.get("data", {}):
        return base64.b64decode(obj["data"][ref["key"]]).decode()
    if optional:
        return None
    raise ConfigError(f"key {ref['key']!r} not found in {kind} {ref['name']!r}")


def container_env(
    pod: Json,
    container: Json,
    lookup: Lookup,
    base: Mapping[str, str],
    node_allocatable: Mapping[str, str],
) -> dict[str, str]:
    """The full environment of ``container``: ``base``, then envFrom, then env, in order."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
            if key not in source:
                continue
            obj = lookup(kind, namespace, source[key]["name"])
            if obj is None:
                if source[key].get("optional", False):
                    continue
                raise ConfigError(f"{kind} {source[key]['name']!r} not found")
            for name, value in obj.get("data", {}).items():
                env[prefix + name] = (
                    value if kind == "configmaps" else base64.b64decode(value).decode()
                )
    for var in container.get("env", []):
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[name] = resource_value(container, source["resourceFieldRef"], node_allocatable)
        elif "configMapKeyRef" in source:
            value = _key_of(lookup, "configmaps", namespace, source["configMapKeyRef"])
            if value is not None:
                env[name] = value
        elif "secretKeyRef" in source:
            value = _key_of(lookup, "secrets", namespace, source["secretKeyRef"])
            if value is not None:
                env[name] = value
        else:
            raise ConfigError(f"unsupported valueFrom for {name!r}: {sorted(source)}")
    return env


def host_base_env(pod: Json, apiserver_host: str, apiserver_port: int) -> dict[str, str]:
    """What every container starts from: a PATH, HOME, the pod's hostname and the
    in-cluster apiserver address (the `kubernetes` Service variables)."""
    port = str(apiserver_port)
    return {
        "PATH": os.environ.get(
            "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        ),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOSTNAME": pod["metadata"]["name"],
        "KUBERNETES_SERVICE_HOST": apiserver_host,
        "KUBERNETES_SERVICE_PORT": port,
        "KUBERNETES_SERVICE_PORT_HTTPS": port,
        "KUBERNETES_PORT": f"tcp://{apiserver_host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP": f"tcp://{apiserver_host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_PORT": port,
        f"KUBERNETES_PORT_{port}_TCP_ADDR": apiserver_host,
    }
