"""The `llmpool serve` command line of an engine container, from a pool's spec."""

from __future__ import annotations

import json

from kubernetes.utils import parse_quantity

from llmpool import pinning
from llmpool.operator import naming
from llmpool.operator.spec import PoolSpec

CHAT_TEMPLATE_PATH = f"{naming.CHAT_TEMPLATE_DIR}/{naming.CHAT_TEMPLATE_KEY}"


def quantity_bytes(quantity: int | str) -> int:
    """A Kubernetes quantity (``2Gi``, ``512M``, ``1073741824``) in whole bytes."""
    return int(parse_quantity(quantity))


def engine_args(spec: PoolSpec, gemm_probe_patience_s: float | None = None) -> list[str]:
    """Arguments after ``llmpool serve``: the model, then vLLM-named flags.

    Every pinned field is passed explicitly, so that an engine's /fingerprint never depends on
    its own defaults; ``--quantization`` is left out for ``none`` (the engine's default, which
    vLLM spells as no flag at all). ``gemm_probe_patience_s`` is the operator's setting
    (``--engine-gemm-probe-patience``), not the pool's; None leaves the engine's default.
    """
    engine = spec.engine
    args = [
        pinning.engine_model_argument(spec.source, spec.revision),
        "--served-model-name", spec.served_name,
        "--revision", spec.revision,
        "--max-model-len", str(spec.max_model_len),
        "--block-size", str(spec.pin.block_size),
        "--kv-cache-dtype", spec.kv_cache_dtype,
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        "--gpu-memory-utilization", repr(float(engine.gpu_memory_utilization)),
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
        "--priority-class", spec.priority_class,
        # Always explicit, so that the bound on a request's priority never rests on a default.
        "--max-request-priority", spec.max_request_priority or spec.priority_class,
        "--shutdown-timeout", str(spec.drain_seconds),
    ]  # fmt: skip
    if spec.quantization != "none":
        args += ["--quantization", spec.quantization]
    if engine.kv_cache_memory is not None:
        args += ["--kv-cache-memory", str(quantity_bytes(engine.kv_cache_memory))]
    if engine.max_queue is not None:
        args += ["--max-queue", str(engine.max_queue)]
    if spec.chat_template is not None:
        args += ["--chat-template", CHAT_TEMPLATE_PATH]
    if engine.compile:
        args += ["--compile", "--compile-cache-dir", naming.COMPILE_CACHE_DIR]
    if engine.speculative is not None:
        # Not pinned: drafts leave every output as it is without them.
        args += ["--speculative-config", json.dumps(dict(engine.speculative))]
    lora = spec.lora_settings
    if lora is not None:
        # Slots only, never --lora-modules: the operator loads the adapters over HTTP
        # (operator/adapters.py), so that adding or removing one never changes the template.
        args += [
            "--enable-lora",
            "--max-loras", str(lora.max_loras),
            "--max-lora-rank", str(lora.max_lora_rank),
        ]  # fmt: skip
    if gemm_probe_patience_s is not None:
        # Not pinned: it decides how long a start may wait for quiet CPUs, not what runs.
        args += ["--gemm-probe-patience", repr(float(gemm_probe_patience_s))]
    args += ["--host", "0.0.0.0", "--port", str(naming.ENGINE_PORT)]
    return args
