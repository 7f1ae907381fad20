"""Ids of stored responses (``/v1/responses``) that say which replica holds them, and who owns
one.

An id is ``resp_<replica token>_<random hex>``; the token is a digest of the replica's pod name
(the engine's hostname, the gateway's ``Replica.name``), so the gateway can send
``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}`` to the one replica that holds
the response without a table, and the id does not show pod names to clients.
"""

from __future__ import annotations

import hashlib
import re
import uuid

from llmpool.protocol.errors import APIError

# The header the gateway sets to the tenant a request was admitted for: engines behind a gateway
# share one engine key per pool, so the key alone does not tell tenants apart. Never taken from
# a client (the gateway forwards only the headers it names).
TENANT_HEADER = "x-llmpool-tenant"
TOKEN_CHARS = 12
RESPONSE_ID = re.compile(rf"resp_([0-9a-f]{{{TOKEN_CHARS}}})_[0-9a-f]{{32}}")


def replica_token(replica_name: str) -> str:
    return hashlib.sha256(replica_name.encode()).hexdigest()[:TOKEN_CHARS]


def new_response_id(token: str) -> str:
    return f"resp_{token}_{uuid.uuid4().hex}"


def token_of(response_id: str) -> str | None:
    """The replica token of an id this fleet made; None for any other string."""
    match = RESPONSE_ID.fullmatch(response_id)
    return None if match is None else match.group(1)


def not_found(response_id: str, param: str = "response_id") -> APIError:
    """The answer for an id that is missing, gone, or another owner's: the same for all three;
    ``param`` is the field that gave the id."""
    return APIError(
        404,
        f"no response with id {response_id!r} is stored (never stored, deleted, expired, evicted,"
        " or its replica is gone)",
        param=param,
        code="response_not_found",
    )
