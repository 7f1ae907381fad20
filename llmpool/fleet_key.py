"""Per-pool engine API keys, derived from one fleet secret.

Engine pods answer only the fleet: each pool's engines require a key that the operator writes into
a Secret of the pool (``llmpool.operator.naming.engine_key_secret_name``) and that the gateway
sends upstream. Both derive it from the fleet key, a random secret the chart creates once and
mounts into the operator and the gateway, as HMAC-SHA256(fleet key, "namespace/pool"). So the
gateway needs no permission to read Secrets in pool namespaces, and a key read from one pool's
Secret opens no other pool. Without a fleet key (``open`` mode, no file) engines run without a key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

FLEET_KEY_FILE_ENV = "LLMPOOL_FLEET_KEY_FILE"
# The key inside the pool's Secret that the engine container reads as LLMPOOL_API_KEY.
ENGINE_KEY_FIELD = "api-key"
ENGINE_KEY_ENV = "LLMPOOL_API_KEY"


def pool_engine_key(fleet_key: bytes, namespace: str, pool: str) -> str:
    """The API key that the engines of ``namespace/pool`` require."""
    digest = hmac.new(fleet_key, f"{namespace}/{pool}".encode(), hashlib.sha256).hexdigest()
    return f"llmpool-{digest}"


class FleetKey:
    """The fleet key read from a mounted Secret file, re-read when the file changes (rotation)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._stamp: tuple[int, int] | None = None
        self._key: bytes | None = None

    @classmethod
    def from_env(cls) -> FleetKey:
        return cls(os.environ.get(FLEET_KEY_FILE_ENV) or None)

    def current(self) -> bytes | None:
        """The key now, or None in open mode (no path). A configured but unreadable file raises."""
        if self.path is None:
            return None
        stat = self.path.stat()
        stamp = (stat.st_mtime_ns, stat.st_ino)
        if stamp != self._stamp:
            key = self.path.read_bytes().strip()
            if not key:
                raise ValueError(f"fleet key file {self.path} is empty")
            self._key, self._stamp = key, stamp
        return self._key

    def engine_key(self, namespace: str, pool: str) -> str | None:
        """The engine key of a pool, or None in open mode."""
        key = self.current()
        return None if key is None else pool_engine_key(key, namespace, pool)
