"""The pinned identity of a replica: the fields every pod of a pool must agree on, and their digest.

Both sides import this module: the engine reports ``pinned_from_engine_args(...)`` at
``GET /fingerprint`` and the operator annotates pod templates with the digest of
``PinnedSettings.pinned(...)``. Drift detection is only sound while the two build the same dict,
so they share one constructor, ``pinned_fields``. ``PinnedSettings.from_spec`` is the one
reader of an LLMPool spec's pinned fields (the operator's ``PoolSpec`` holds one). Standard
library only: the engine imports it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

PINNED_KEYS = (
    "source",
    "revision",
    "servedName",
    "chatTemplateSha256",
    "quantization",
    "kvCacheDtype",
    "maxModelLen",
    "blockSize",
)

# Defaults shared with the CRD (crds/llmpool.yaml) and the engine flags.
DEFAULT_QUANTIZATION = "none"
DEFAULT_KV_CACHE_DTYPE = "auto"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_MODEL_LEN = 4096

# Where engine pods find pvc:// and hf:// models (see engine_model_argument).
PVC_MOUNT_ROOT = "/models/pvc"
HF_CACHE_ROOT = "/models/hf"


def chat_template_sha256(template: str | bytes | None) -> str | None:
    """Hex sha256 of the template bytes a pod reads (UTF-8); ``None`` means the model's own."""
    if template is None:
        return None
    data = template.encode("utf-8") if isinstance(template, str) else template
    return hashlib.sha256(data).hexdigest()


def default_served_name(source: str) -> str:
    """The last path segment of a model source: ``hf://org/name`` -> ``name``."""
    return source.rstrip("/").rsplit("/", 1)[-1]


def pinned_fields(
    *,
    source: str,
    revision: str,
    served_name: str | None,
    chat_template: str | bytes | None,
    quantization: str | None,
    kv_cache_dtype: str | None,
    max_model_len: int,
    block_size: int | None,
) -> dict[str, Any]:
    """The canonical pinned dict; ``None`` for an optional setting means its default."""
    return {
        "source": source,
        "revision": revision,
        "servedName": served_name or default_served_name(source),
        "chatTemplateSha256": chat_template_sha256(chat_template),
        "quantization": quantization or DEFAULT_QUANTIZATION,
        "kvCacheDtype": kv_cache_dtype or DEFAULT_KV_CACHE_DTYPE,
        "maxModelLen": int(max_model_len),
        "blockSize": int(block_size or DEFAULT_BLOCK_SIZE),
    }


def engine_model_argument(source: str, revision: str) -> str:
    """The MODEL argument an engine pod gets for an LLMPool source.

    The engine loads local folders, so the operator mounts pvc:// claims under
    ``PVC_MOUNT_ROOT`` and reads hf:// models from the Hugging Face cache layout under
    ``HF_CACHE_ROOT`` (the snapshot folder of the pinned commit). The pinned ``source`` is
    this argument: it is what the engine knows and reports.
    """
    if source.startswith("pvc://"):
        return f"{PVC_MOUNT_ROOT}/{source.removeprefix('pvc://')}"
    if source.startswith("hf://"):
        org, name = source.removeprefix("hf://").split("/", 1)
        return f"{HF_CACHE_ROOT}/hub/models--{org}--{name}/snapshots/{revision}"
    return source


@dataclass(frozen=True)
class PinnedSettings:
    """The pinned settings of an LLMPool spec, with the CRD's defaults for those left out."""

    source: str
    revision: str
    served_name: str
    quantization: str = DEFAULT_QUANTIZATION
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> PinnedSettings:
        model = spec["model"]
        engine = spec.get("engine") or {}
        return cls(
            source=model["source"],
            revision=model["revision"],
            served_name=model.get("servedName") or default_served_name(model["source"]),
            quantization=spec.get("quantization", DEFAULT_QUANTIZATION),
            kv_cache_dtype=spec.get("kvCacheDtype", DEFAULT_KV_CACHE_DTYPE),
            max_model_len=spec.get("maxModelLen", DEFAULT_MAX_MODEL_LEN),
            block_size=engine.get("blockSize", DEFAULT_BLOCK_SIZE),
        )

    def pinned(self, chat_template: str | None) -> dict[str, Any]:
        """The pinned dict; ``chat_template`` is the text pods will mount."""
        # The fields are pinned_fields' arguments; the engine knows the model by its argument.
        settings = asdict(self) | {"source": engine_model_argument(self.source, self.revision)}
        return pinned_fields(**settings, chat_template=chat_template)


def pinned_from_spec(spec: Mapping[str, Any], chat_template: str | None) -> dict[str, Any]:
    """The pinned dict of an LLMPool ``spec``; ``chat_template`` is the text pods will mount."""
    return PinnedSettings.from_spec(spec).pinned(chat_template)


def pinned_from_engine_args(
    args: Any,
    chat_template: str | bytes | None,
    *,
    source: str | None = None,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The pinned dict of an engine started with vLLM-named settings.

    ``args`` is anything with the attributes ``model``, ``revision``, ``served_model_name``
    (a string or a list, as in vLLM), ``max_model_len`` and ``block_size``, and optionally
    ``quantization`` and ``kv_cache_dtype`` (an argparse namespace or the engine's config).
    ``chat_template`` is the content of the ``--chat-template`` file, or ``None`` when the
    model's own is used. ``source`` and ``max_model_len`` override what ``args`` left to the
    engine to decide (the default model, the model's context length).
    """
    served_name = args.served_model_name
    if isinstance(served_name, list | tuple):
        served_name = served_name[0] if served_name else None
    resolved_source = source or args.model
    return pinned_fields(
        source=resolved_source,
        revision=args.revision,
        served_name=served_name,
        chat_template=chat_template,
        quantization=getattr(args, "quantization", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
        max_model_len=max_model_len or args.max_model_len,
        block_size=args.block_size,
    )


def canonical_json(pinned: Mapping[str, Any]) -> str:
    return json.dumps(pinned, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def pinned_digest(pinned: Mapping[str, Any]) -> str:
    """``sha256:`` + hex sha256 of the canonical JSON of ``pinned``."""
    return "sha256:" + hashlib.sha256(canonical_json(pinned).encode("utf-8")).hexdigest()
