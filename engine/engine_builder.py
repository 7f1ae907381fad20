"""Building an engine, one function per step: read the checkpoint, load the model, size and
allocate the KV cache, calibrate fp8 KV scales, probe the kernels, start the compile.

``LoadedEngine`` runs them in that order; ``EngineCore`` adds the step loop to what it builds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from llmpool import capacity
from llmpool.engine import model_source
from llmpool.engine.attention import Backend, check_kv_cache_dtype, select_backend
from llmpool.engine.background_compile import BackgroundCompile
from llmpool.engine.compile_cache import CompileCache, CompileReport, cache_root, environment_fields
from llmpool.engine.config import EngineConfig
from llmpool.engine.gemm_store import GemmStore
from llmpool.engine.huge_pages import move_to_huge_pages
from llmpool.engine.kernels import cpu_decoder
from llmpool.engine.kernels.capabilities import KernelCapabilities
from llmpool.engine.kernels.capabilities import probe_kernels as probe_capabilities
from llmpool.engine.kv_cache import (
    FP8_DTYPE,
    FP8_KV_SCALE_HEADROOM,
    KV_CALIBRATION_TEXT,
    allocate_kv_caches,
    cache_dtype,
    fp8_kv_scale,
)
from llmpool.engine.kv_cache_manager import KVCacheManager
from llmpool.engine.lora.manager import LoraManager
from llmpool.engine.models.linear import BFLOAT16_KERNELS
from llmpool.engine.models.llama import LlamaForCausalLM, LlamaShape
from llmpool.engine.models.loader import SUPPORTED_MODEL_TYPES, load_weights
from llmpool.engine.models.quantization import quantize

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


class LoadedEngine:
    """A model loaded on its device with its KV cache and its kernels chosen, built in the
    order below. ``EngineCore`` is a LoadedEngine that runs requests."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.resolved = model_source.resolve(config.model)
        model_source.verify_revision(self.resolved, config.revision)
        folder = self.resolved.folder
        self.shape = read_shape(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.max_model_len = max_model_len(config, self.shape)
        self.eos_token_ids = eos_token_ids(folder, self.tokenizer)
        self.device = config.torch_device()
        self.resolved_dtype = config.resolved_dtype(self.device)
        self.dtype = self.resolved_dtype.dtype
        kv_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)
        # The KV-cache dtype as llmpool.capacity names it.
        self.kv_dtype_name = "fp8" if kv_dtype == FP8_DTYPE else self.resolved_dtype.name
        self.kernels = probe_kernels(config, self.shape, self.device, self.dtype)
        self.backend = select_backend(
            self.device, config.attention_backend, kv_dtype, kernels=self.kernels
        )
        check_kv_cache_dtype(self.backend, kv_dtype, self.device)
        self.model, self.capacity_shape = load_model(
            config, folder, self.shape, self.backend, self.max_model_len, self.device, self.dtype,
            self.kernels,
        )  # fmt: skip
        # LoRA slots are allocated before the KV pool, so that a GPU's budget sees them.
        self.lora = enable_lora(config, self.model, self.device, self.dtype)
        num_blocks = num_kv_blocks(
            config, self.shape, self.capacity_shape, self.kv_dtype_name, self.max_model_len,
            self.device,
        )  # fmt: skip
        block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.kv_caches = allocate_kv_caches(
            self.shape.num_layers, num_blocks, block_size, self.shape.num_kv_heads,
            self.shape.head_dim, kv_dtype, self.device,
        )  # fmt: skip
        if kv_dtype == FP8_DTYPE:
            token_ids = self.tokenizer.encode(KV_CALIBRATION_TEXT)[: self.max_model_len]
            calibrate_fp8_kv_scales(self.model, token_ids, block_size, self.dtype)
        self.compile: BackgroundCompile | None = None
        if config.compile:
            max_tokens = min(
                config.max_num_batched_tokens, self.max_model_len, num_blocks * block_size
            )
            self.compile = BackgroundCompile(
                self.model, self.kv_caches, block_size, max_tokens, self.compile_cache(max_tokens)
            )
            self.compile.start()

    @property
    def compile_report(self) -> CompileReport:
        """Where the decoder's compile stands (state "off" without ``config.compile``)."""
        return CompileReport(enabled=False) if self.compile is None else self.compile.report

    def wait_for_compile(self, timeout: float | None = None) -> None:
        """Block until the compiled decoder is in use (no-op without ``config.compile``); raise
        what made the compile fail. The server does not wait: it serves eager meanwhile."""
        if self.compile is not None:
            self.compile.wait(timeout)

    def compile_cache(self, max_tokens: int) -> CompileCache | None:
        """The cache entry for this engine's compiled decoder; None where the cache is off.

        The key holds every input of the traced graphs: the model's content, the settings that
        change the decoder's ops or sizes, the kernels chosen (they are branches of the graph),
        and the environment that generates and builds the code."""
        root = cache_root(self.config.compile_cache_dir)
        if root is None:
            return None
        fields = {
            **environment_fields(),
            "model": self.resolved.revision,
            "dtype": self.resolved_dtype.name,
            "quantization": self.config.quantization,
            "kvCacheDtype": self.kv_dtype_name,
            "attentionBackend": self.backend.name,
            "blockSize": str(self.config.block_size),
            "maxTokens": str(max_tokens),
            "kernels": repr(self.kernels),
        }
        return CompileCache(root, fields)


def gemm_store(
    config: EngineConfig, dtype: torch.dtype, gemm_shape: tuple[int, int] | None
) -> GemmStore | None:
    """Where a compiling engine keeps its GEMM choice, beside its compile cache, so that its
    next start and the replicas sharing the cache compile the same graph (``gemm_store``);
    None without ``--compile``, without the cache, or with no GEMM to choose."""
    root = cache_root(config.compile_cache_dir)
    if not config.compile or root is None or gemm_shape is None:
        return None
    fields = {
        **environment_fields(),
        "dtype": str(dtype).removeprefix("torch."),
        "weightShape": "x".join(map(str, gemm_shape)),
        # What the probes choose among: a kernel way added since (the widened bf16_gemm, with
        # the llmpool version unchanged) is another key, so a stored choice made without it is
        # probed over instead of standing.
        "bfloat16Kernels": ",".join(BFLOAT16_KERNELS),
    }
    return GemmStore(root, fields)


def read_shape(folder: Path) -> LlamaShape:
    """The checkpoint's shape, read from its config, for a model type this engine runs."""
    hf_config = AutoConfig.from_pretrained(folder)
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {hf_config.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    return LlamaShape.from_hf_config(hf_config)


def max_model_len(config: EngineConfig, shape: LlamaShape) -> int:
    """``max_model_len``, or the model's context length where it is unset; never past it."""
    length = config.max_model_len or shape.max_position_embeddings
    if length > shape.max_position_embeddings:
        raise ValueError(
            f"max_model_len {length:,} exceeds the model's context length"
            f" {shape.max_position_embeddings:,}"
        )
    return length


def eos_token_ids(folder: Path, tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json (may be a list) plus the tokenizer's own."""
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:
        eos = None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def load_model(
    config: EngineConfig,
    folder: Path,
    shape: LlamaShape,
    backend: Backend,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    kernels: KernelCapabilities,
) -> tuple[LlamaForCausalLM, capacity.ModelShape]:
    """The model's weights loaded, quantized and cast, on the device (on the CPU, in huge
    pages); and its shape as llmpool.capacity sizes memory for it (parameters counted before
    quantization)."""
    model = LlamaForCausalLM(shape, backend, max_positions=max_positions, gemm=kernels.gemm)
    load_weights(model, folder)
    num_parameters = sum(p.numel() for p in model.parameters())
    # From the float32 checkpoint weights, before the cast.
    quantize(model, config.quantization, kernels)
    model = model.to(device=device, dtype=dtype).eval()
    model.cos_sin_cache = model.cos_sin_cache.to(device)
    if device.type == "cpu":
        move_to_huge_pages(model)
    # Now the weights are where they stay, and the C decoder holds their addresses.
    model.cpu_decoder = cpu_decoder.for_model(model, kernels)
    return model, model_shape_for_capacity(shape, num_parameters)


def model_shape_for_capacity(shape: LlamaShape, num_parameters: int) -> capacity.ModelShape:
    return capacity.ModelShape(
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_parameters=num_parameters,
        max_position_embeddings=shape.max_position_embeddings,
        embedding_parameters=capacity.embedding_parameters(
            shape.vocab_size, shape.hidden_size, shape.tie_word_embeddings
        ),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_heads=shape.num_heads,
    )


def enable_lora(
    config: EngineConfig, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype
) -> LoraManager | None:
    """The adapter slots, wired into the model, when ``enable_lora`` asks for them."""
    if not config.enable_lora:
        return None
    lora = LoraManager(model.shape, config.max_loras, config.max_lora_rank, dtype, device)
    model.enable_lora(lora.stacks)
    return lora


def num_kv_blocks(
    config: EngineConfig,
    shape: LlamaShape,
    capacity_shape: capacity.ModelShape,
    kv_dtype_name: str,
    max_model_len: int,
    device: torch.device,
) -> int:
    """The KV pool's blocks: ``num_kv_blocks``, else what fits in the cache's memory."""
    block_size = config.block_size
    blocks_per_seq = -(-max_model_len // block_size)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        memory = config.kv_cache_memory or default_kv_cache_bytes(config, shape, device)
        num_blocks = capacity.num_kv_blocks(capacity_shape, kv_dtype_name, block_size, int(memory))
        # More blocks than every sequence at full length could use is memory for nothing.
        num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV pool holds {num_blocks * block_size:,} tokens ({num_blocks} blocks of {block_size}),"
            f" fewer than one sequence of max_model_len {max_model_len:,}; lower max_model_len"
            " or give the cache more memory"
        )
    return num_blocks


def default_kv_cache_bytes(config: EngineConfig, shape: LlamaShape, device: torch.device) -> int:
    """2 GiB on CPU; on CUDA what ``gpu_memory_utilization`` leaves beside the loaded weights."""
    if device.type != "cuda":
        return CPU_DEFAULT_KV_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free
    # Keep room for one step's activations and logits beside the weights already loaded.
    activations = config.max_num_batched_tokens * (shape.hidden_size * 16 + shape.vocab_size * 4)
    budget = int(total * config.gpu_memory_utilization) - used_by_others - activations
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no memory for the KV cache"
        )
    return budget


def calibrate_fp8_kv_scales(
    model: LlamaForCausalLM, token_ids: list[int], block_size: int, dtype: torch.dtype
) -> None:
    """Set each layer's fp8 KV scales from the amax of its K and V over a fixed text.

    One forward of ``KV_CALIBRATION_TEXT``'s ``token_ids`` through a cache in the model's dtype (the pool is
    already allocated, so its size did not count this pass's memory). This runs before the
    scheduler exists and the scales never change afterwards: a prefix-cache block holds
    ``K / k_scale``, and a block written under other scales would be read wrong by every
    request that shares it. The scales follow from the pinned weights and the fixed text,
    so they are not part of the fingerprint.
    """
    amax = model.measure_kv_amax(token_ids, block_size, dtype)
    model.set_kv_scales([(fp8_kv_scale(k), fp8_kv_scale(v)) for k, v in amax])
    k_amax, v_amax = [k for k, _ in amax], [v for _, v in amax]
    logger.info(
        "fp8 KV scales calibrated on %d tokens: k amax %.3g..%.3g, v amax %.3g..%.3g"
        " across %d layers, each stored at e4m3 max / %g",
        len(token_ids), min(k_amax), max(k_amax), min(v_amax), max(v_amax),
        len(amax), FP8_KV_SCALE_HEADROOM,
    )  # fmt: skip


def probe_kernels(
    config: EngineConfig, shape: LlamaShape, device: torch.device, dtype: torch.dtype
) -> KernelCapabilities:
    """Probe, once for this engine, the kernels its layers and backend run, and say which."""
    dense = config.quantization == "none"  # quantized layers have their own kernels
    gemm_shape = (2 * shape.intermediate_size, shape.hidden_size) if dense else None
    store = gemm_store(config, dtype, gemm_shape) if device.type == "cpu" else None
    kernels = probe_capabilities(device, dtype, gemm_shape, store, config.gemm_probe_patience_s)
    if not dense and device.type == "cpu":
        logger.info(
            "%s decodes on this CPU: %s",
            config.quantization,
            "the VNNI kernels (vnni_gemm)"
            if kernels.vnni_gemm
            else "torch's weight-only kernels (the VNNI ones need AVX-512 VNNI and VBMI and gcc)",
        )
    return kernels
