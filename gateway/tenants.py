"""Who is calling: API keys, kept as sha256 digests, each bound to a tenant's scope and limits.

Three modes:

- open (no ``--api-key``, no ``--api-key-namespace``): every caller is the tenant ``open`` and
  may use every watched pool; for a cluster that one team owns.
- one key (``--api-key`` / ``LLMPOOL_GATEWAY_API_KEY``): that key is the tenant ``default``,
  which may use every watched pool.
- tenants (``--api-key-namespace NS``): the keys are Secrets in NS labelled
  ``llmpool.dev/api-key: "true"``, watched, so a key added, rotated or removed takes effect
  without a restart. A Secret's data (``kubectl create secret generic --from-literal=...``):

  ``api-key`` (required)        the key clients send as ``Authorization: Bearer KEY``
  ``scope`` (required)          what it may use: namespaces (``team-a``), pools
                                (``team-a/chat``) or ``*``, separated by commas or spaces
  ``tenant``                    the tenant's name (metrics, limits); default the Secret's name
  ``max-concurrent``            requests in progress at once
  ``requests-per-minute``
  ``tokens-per-minute``         tokens reserved at admission (``RequestFacts.cost``), settled
                                against the usage the engine returns
  ``max-held``                  requests waiting for a pool without a ready replica

  Keys of one tenant with the same limits share its counters. A Secret that cannot be read
  is skipped and logged by name. ``--api-key`` may be given too: a key for every watched pool, beside the tenants'.

Keys, prompts and completions are never logged.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmpool.gateway.limits import TenantLimits
from llmpool.gateway.pools import Pool
from llmpool.protocol.errors import APIError

logger = logging.getLogger(__name__)

API_KEY_LABEL = "llmpool.dev/api-key"
API_KEY_SELECTOR = f"{API_KEY_LABEL}=true"
EVERYTHING = "*"
LIMIT_FIELDS = {
    "max-concurrent": "max_concurrent",
    "requests-per-minute": "requests_per_minute",
    "tokens-per-minute": "tokens_per_minute",
    "max-held": "max_held",
}


@dataclass(frozen=True)
class Tenant:
    name: str
    scope: frozenset[str]  # "*", "namespace" or "namespace/pool" entries
    limits: TenantLimits = TenantLimits()

    def may_use(self, pool: Pool) -> bool:
        return bool({EVERYTHING, pool.namespace, pool.label} & self.scope)


OPEN = Tenant("open", frozenset({EVERYTHING}))
DEFAULT = Tenant("default", frozenset({EVERYTHING}))


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def invalid_api_key() -> APIError:
    return APIError(
        401, "incorrect or missing API key: send 'Authorization: Bearer KEY'",
        code="invalid_api_key",
    )  # fmt: skip


def tenant_from_secret(secret: Mapping[str, Any]) -> tuple[bytes, Tenant]:
    """The key's digest and its tenant, from a Secret as the API server returns it; a Secret
    that does not say both raises ValueError naming the field (never its value)."""
    name = secret["metadata"]["name"]
    data = {}
    for field, value in (secret.get("data") or {}).items():
        try:
            data[field] = base64.b64decode(value, validate=True).decode().strip()
        except (binascii.Error, UnicodeDecodeError):
            raise ValueError(f"field {field!r} is not base64 of UTF-8 text") from None
    if not data.get("api-key"):
        raise ValueError("field 'api-key' is missing or empty")
    scope = frozenset(data.get("scope", "").replace(",", " ").split())
    if not scope:
        raise ValueError("field 'scope' is missing or empty: name namespaces, pools or '*'")
    limits = {}
    for field, attribute in LIMIT_FIELDS.items():
        if field in data:
            try:
                limits[attribute] = int(data[field])
            except ValueError:
                raise ValueError(f"field {field!r} is not an integer") from None
            if limits[attribute] < 0:
                raise ValueError(f"field {field!r} is negative")
    tenant = Tenant(data.get("tenant") or name, scope, TenantLimits(**limits))
    return digest(data["api-key"]), tenant


class KeyRing:
    """The keys a gateway accepts. ``open`` (no key at all) lets every caller in as ``OPEN``."""

    def __init__(self, api_key: str | None = None, from_secrets: bool = False) -> None:
        self.open = api_key is None and not from_secrets
        self._static = {digest(api_key): DEFAULT} if api_key is not None else {}
        self._secrets: dict[str, tuple[bytes, Tenant]] = {}  # Secret name -> digest, tenant
        self._keys = dict(self._static)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The caller's tenant, or a 401 (``invalid_api_key``)."""
        if self.open:
            return OPEN
        scheme, _, key = (authorization or "").partition(" ")
        tenant = self._keys.get(digest(key.strip())) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise invalid_api_key()
        return tenant

    def tenant_limits(self) -> list[tuple[str, TenantLimits]]:
        """Each tenant's name and limits, once per distinct pair (its keys may share them)."""
        return sorted({(t.name, t.limits) for t in self._keys.values()}, key=lambda p: p[0])

    # --- from the watched Secrets, on the event loop ------------------------------------------

    def set_secret(self, secret: Mapping[str, Any]) -> None:
        name = secret["metadata"]["name"]
        try:
            self._secrets[name] = tenant_from_secret(secret)
        except (ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring API key Secret %s: %s", name, error)
            self._secrets.pop(name, None)
        self._rebuild()

    def delete_secret(self, name: str) -> None:
        self._secrets.pop(name, None)
        self._rebuild()

    def reset_secrets(self, secrets: Iterable[Mapping[str, Any]]) -> None:
        self._secrets = {}
        for secret in secrets:
            self.set_secret(secret)
        self._rebuild()

    def _rebuild(self) -> None:
        self._keys = {**dict(self._secrets.values()), **self._static}
