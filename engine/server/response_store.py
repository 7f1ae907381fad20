"""Stored responses of one replica (``store``, ``previous_response_id``, ``GET``/``DELETE
/v1/responses/{id}``): in memory, bounded by count, bytes and age, and per API key.

Each response belongs to the caller that made it (``owner_of``: its API key, and the tenant the
gateway names); a response of another owner is answered exactly as one that does not exist, so a
key learns nothing of another's. A restart loses them all, as any eviction does: a client then
gets a 404 naming the id and sends the conversation again.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from llmpool.protocol.response_ids import TENANT_HEADER, new_response_id, not_found, replica_token


@dataclass(frozen=True)
class StoreLimits:
    """``llmpool serve --response-store-*``; ``max_count`` 0 stores nothing."""

    max_count: int = 1000
    max_bytes: int = 64 * 1024 * 1024
    max_age_s: float = 3600.0
    max_per_owner: int = 100


@dataclass
class StoredResponse:
    owner: str
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages up to its answer, instructions left out
    size: int  # bytes of both as JSON
    stored_at: float


def owner_of(request: Request) -> str:
    """Who may read a response: a digest of the request's API key and gateway tenant."""
    key = request.headers.get("authorization", "")
    tenant = request.headers.get(TENANT_HEADER, "")
    return hashlib.sha256(f"{key}\n{tenant}".encode()).hexdigest()


class ResponseStore:
    """Oldest first out: past any bound, the oldest responses (of the owner, for its own bound)
    are dropped. Read from the request-preparing thread and written from the event loop, so
    each method holds a lock."""

    def __init__(
        self,
        replica_name: str,
        limits: StoreLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.token = replica_token(replica_name)
        self.limits = limits
        self.clock = clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def new_id(self) -> str:
        return new_response_id(self.token)

    def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response``; False when it alone is over a bound (it is then not kept)."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(
            json.dumps(conversation, ensure_ascii=False)
        )
        if self.limits.max_count == 0 or size > self.limits.max_bytes:
            return False
        with self._lock:
            self._put(owner, response, conversation, size)
        return True

    def _put(
        self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]], size: int
    ) -> None:
        self._expire()
        owned = [key for key, stored in self._responses.items() if stored.owner == owner]
        for key in owned[: max(len(owned) + 1 - self.limits.max_per_owner, 0)]:
            self._drop(key)
        while self._responses and (
            len(self._responses) >= self.limits.max_count
            or self._bytes + size > self.limits.max_bytes
        ):
            self._drop(next(iter(self._responses)))
        self._responses[response["id"]] = StoredResponse(
            owner, response, conversation, size, self.clock()
        )
        self._bytes += size

    def get(self, owner: str, response_id: str, param: str = "response_id") -> StoredResponse:
        """The owner's response, or a 404 naming the id (also for another owner's) and the
        field that gave it."""
        with self._lock:
            self._expire()
            stored = self._responses.get(response_id)
        if stored is None or stored.owner != owner:
            raise not_found(response_id, param)
        return stored

    def delete(self, owner: str, response_id: str) -> None:
        self.get(owner, response_id)
        with self._lock:
            if response_id in self._responses:
                self._drop(response_id)

    def __len__(self) -> int:
        return len(self._responses)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def _expire(self) -> None:
        oldest_kept = self.clock() - self.limits.max_age_s
        while self._responses:
            key, stored = next(iter(self._responses.items()))
            if stored.stored_at >= oldest_kept:
                return
            self._drop(key)

    def _drop(self, response_id: str) -> None:
        self._bytes -= self._responses.pop(response_id).size
