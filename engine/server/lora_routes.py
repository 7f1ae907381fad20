"""LoRA adapters over HTTP: vLLM's load and unload routes, and the adapters as models.

A load reads and checks the adapter's files in a worker thread (megabytes of safetensors, never
on the event loop), then copies it into a slot on the engine thread between two steps
(``AsyncEngine.call``): a step never sees a half-written slot, and a load that fails anywhere
changes nothing but the record of failures that ``/fingerprint`` shows.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from llmpool import names
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.lora.adapter import AdapterError
from llmpool.engine.lora.manager import UnknownAdapterError
from llmpool.engine.server.async_engine import AsyncEngine
from llmpool.protocol.errors import APIError, bad_request, parse_json_body
from llmpool.protocol.http import read_body

# Codes of AdapterError that mean "the slot table cannot take this now", not "these files are bad".
CONFLICT_CODES = frozenset({"adapter_exists", "lora_slots_full"})


def adapter_error(error: AdapterError) -> APIError:
    """409 for a conflict with what is loaded, 400 for files that cannot be served."""
    status = 409 if error.code in CONFLICT_CODES else 400
    return APIError(status, str(error), param="lora_path", code=error.code)


def model_not_found(error: UnknownAdapterError) -> APIError:
    return APIError(404, str(error), param="model", code="model_not_found")


class LoraRoutes:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, and the model cards."""

    def __init__(self, core: EngineCore, engine: AsyncEngine, served_model_name: str) -> None:
        self.core = core
        self.engine = engine
        self.served_model_name = served_model_name

    def adapter_for(self, model: str) -> str | None:
        """The loaded adapter a request's ``model`` names, compared in the names' normal form,
        by the name it was loaded under; None when it names none (any thread)."""
        lora = self.core.lora
        if lora is None:
            return None
        wanted = names.normalize(model)
        return next((name for name in lora.registry if names.normalize(name) == wanted), None)

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        lora = self.core.lora
        if lora is None:
            return []
        return [
            {
                "id": adapter.name,
                "object": "model",
                "created": created,
                "owned_by": "llmpool",
                "root": adapter.path,
                "parent": self.served_model_name,
                "max_model_len": self.core.max_model_len,
            }
            for adapter in sorted(lora.registry.values(), key=lambda a: a.name)
        ]

    async def load(self, request: Request) -> Response:
        """vLLM's body ``{lora_name, lora_path, load_inplace?}`` plus our ``revision?``
        (``sha256:...`` of the files, refused if they differ). Loading the same name with the
        same files again is a no-op; other files under a loaded name need ``load_inplace``."""
        body = parse_json_body(await read_body(request))
        name = self._name(body)
        path = _string(body, "lora_path")
        revision = body.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise bad_request("revision must be a string (sha256:...)", param="revision")
        load_inplace = body.get("load_inplace", False)
        if not isinstance(load_inplace, bool):
            raise bad_request("load_inplace must be a boolean", param="load_inplace")
        core = self.core
        try:
            weights = await asyncio.to_thread(core.prepare_adapter, name, path, revision)
            await self.engine.call(lambda: core.install_adapter(weights, replace=load_inplace))
        except AdapterError as error:
            raise adapter_error(error) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        body = parse_json_body(await read_body(request))
        name = self._name(body)
        core = self.core
        try:
            await self.engine.call(lambda: core.unload_adapter(name))
        except UnknownAdapterError:
            raise APIError(
                404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                code="adapter_not_found",
            ) from None  # fmt: skip
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def _name(self, body: dict[str, Any]) -> str:
        if self.core.lora is None:
            raise bad_request(
                "LoRA is not enabled on this server (start it with --enable-lora)",
                code="lora_not_enabled",
            )
        name = _string(body, "lora_name")
        error = names.name_error(name, "lora_name")
        if error is not None:
            raise bad_request(error, param="lora_name", code="invalid_lora_name")
        if names.normalize(name) == names.normalize(self.served_model_name):
            raise bad_request(
                f"lora_name {name!r} is the served model's name", param="lora_name",
                code="invalid_lora_name",
            )  # fmt: skip
        # A loaded adapter's name in another case is that adapter: loading it again is a no-op
        # or a conflict, unloading it unloads it.
        return self.adapter_for(name) or name


def _string(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{key} must be a non-empty string", param=key)
    return value
