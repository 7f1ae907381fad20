"""GET /fingerprint: what this replica was pinned to and what it observably runs."""

from __future__ import annotations

import itertools
from typing import Any

from llmpool import __version__, pinning
from llmpool.engine import huge_pages, model_source
from llmpool.engine.engine_core import EngineCore


def build_fingerprint(
    core: EngineCore,
    served_model_name: str,
    chat_template_file: bytes | None,
    chat_template_in_use: str | None,
) -> dict[str, Any]:
    """``pinned`` is built by the same function the operator uses, so the digests agree.

    ``chat_template_file`` is the ``--chat-template`` file's bytes (None: the model's own);
    observed digests are computed from the files actually loaded, which takes a moment, so the
    server calls this once and caches the answer.
    """
    config = core.config
    pinned = pinning.pinned_fields(
        source=core.resolved.source,
        revision=core.resolved.revision,
        served_name=served_model_name,
        chat_template=chat_template_file,
        quantization=getattr(config, "quantization", None),
        kv_cache_dtype=getattr(config, "kv_cache_dtype", None),
        max_model_len=core.max_model_len,
        block_size=config.block_size,
    )
    folder = core.resolved.folder
    decoder = core.model.cpu_decoder
    probe = core.kernels.gemm_probe
    observed = {
        "weightsDigest": model_source.weights_digest(folder),
        "tokenizerDigest": model_source.tokenizer_digest(folder),
        "chatTemplateSha256": pinning.chat_template_sha256(chat_template_in_use),
        "dtype": core.resolved_dtype.name,
        # Why: `auto` depends on the node's CPU, so siblings may differ (not part of the pin).
        "dtypeReason": core.resolved_dtype.reason,
        "kvDtype": core.kv_dtype_name,
        "device": str(core.device),
        "attentionBackend": core.backend.name,
        # Which CPU GEMMs run where, timed at start: not part of the pin, as the dtype.
        "gemm": core.kernels.gemm.as_observed(),
        # How its probes ran: how many times, and how much of the CPUs neighbours used in the
        # run that chose (a high share: the choice may not be this CPU's; None: not probed).
        "gemmProbe": None if probe is None else probe.as_observed(),
        # Decode steps of up to this many rows run in the C decoder (None: layer by layer).
        "cDecoderMaxRows": None if decoder is None else decoder.max_rows,
        # How much of the CPU weights and KV cache the kernel backs with 2 MiB pages (None on
        # a GPU; 0 where THP is off, and decode steps run slower).
        "hugePages": huge_pages.observed(
            [*core.model.parameters(), *core.model.buffers(), *itertools.chain(*core.kv_caches)]
        )
        if core.device.type == "cpu"
        else None,
        "engineVersion": __version__,
    }
    return {"pinned": pinned, "observed": observed, "digest": pinning.pinned_digest(pinned)}


def live_fields(cached: dict[str, Any], core: EngineCore) -> dict[str, Any]:
    """``cached`` (:func:`build_fingerprint`'s answer) with what changes while the replica runs:
    ``observed.compile`` (whether the decoder is compiling, compiled or failed, from the compile
    cache or cold, and how long it took) and the LoRA fields."""
    observed = {**cached["observed"], "compile": core.compile_report.as_dict()}
    return {**cached, "observed": observed, **lora_fields(core)}


def lora_fields(core: EngineCore) -> dict[str, Any]:
    """The LoRA part of ``/fingerprint``, read live on every call: adapters are loaded and
    unloaded while the replica runs, so they stay outside ``pinned`` and its digest, and the
    operator judges their drift from these fields alone."""
    lora = core.lora
    if lora is None:
        return {"lora": None, "adapters": [], "adapterFailures": []}
    failures = lora.failures  # replaced whole by the thread that loads: read it once
    return {
        "lora": {"maxLoras": lora.max_loras, "maxLoraRank": lora.max_rank},
        "adapters": lora.describe(),
        "adapterFailures": [failures[name] for name in sorted(failures)],
    }
