"""Requests addressed to a stored response go to the one replica that holds it.

A stored response lives on the replica that made it, and its id carries a digest of that
replica's pod name (``llmpool.protocol.response_ids``). So ``previous_response_id`` on
``POST /v1/responses`` pins the request to that replica, and ``GET``/``DELETE
/v1/responses/{id}`` go to it among the replicas of the pools the tenant may use; when no such
replica is routable any more, the answer is the engine's own 404 naming the id.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmpool.gateway.pools import Replica
from llmpool.protocol.response_ids import not_found, replica_token, token_of


def holder(replicas: Iterable[Replica], response_id: str, param: str = "response_id") -> Replica:
    """The replica whose token ``response_id`` carries; a 404 naming the id (and ``param``, the
    field that gave it) without one."""
    token = token_of(response_id)
    for replica in replicas:
        if token is not None and replica_token(replica.name) == token:
            return replica
    raise not_found(response_id, param)
