"""EngineCore: loads the model and KV pool, then runs schedule -> forward -> sample, step by step."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from llmpool import capacity
from llmpool.engine import compilation, model_source
from llmpool.engine.admission import InvalidRequestError, Limits, admit
from llmpool.engine.attention import check_kv_cache_dtype, select_backend
from llmpool.engine.config import EngineConfig
from llmpool.engine.detokenizer import IncrementalDetokenizer
from llmpool.engine.kernels.capabilities import probe_kernels
from llmpool.engine.kv_cache_manager import KVCacheManager
from llmpool.engine.lora.adapter import AdapterError, AdapterWeights, read_adapter
from llmpool.engine.lora.manager import LoadedAdapter, LoraManager, UnknownAdapterError
from llmpool.engine.model_runner import ModelRunner
from llmpool.engine.models.llama import LlamaForCausalLM, LlamaShape
from llmpool.engine.models.loader import SUPPORTED_MODEL_TYPES, load_weights
from llmpool.engine.models.quantization import (
    FP8_DTYPE,
    FP8_KV_SCALE_HEADROOM,
    KV_CALIBRATION_TEXT,
    fp8_kv_scale,
    quantize,
)
from llmpool.engine.outputs import RequestDelta
from llmpool.engine.priority import PRIORITY_CLASSES
from llmpool.engine.request import Request, RequestStatus
from llmpool.engine.sampling_params import SamplingParams
from llmpool.engine.scheduler import Scheduler
from llmpool.engine.structured_outputs import GrammarError, StructuredOutputManager

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (vLLM counts tokens)
    prefix_cache_hits: int  # of those, tokens found cached
    grammar_mask_seconds: float = 0.0  # structured-output masks, computed beside the forwards
    grammar_wait_seconds: float = 0.0  # of that, what steps waited for after their forward
    grammar_steps: int = 0  # steps that computed masks
    running_adapters: tuple[str, ...] = ()  # LoRA adapters of the running requests, sorted
    waiting_adapters: tuple[str, ...] = ()  # and of the waiting ones


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


class EngineCore:
    """The synchronous engine: no threads, no event loop; the async front end drives ``step()``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.resolved = model_source.resolve(config.model)
        model_source.verify_revision(self.resolved, config.revision)
        folder = self.resolved.folder
        hf_config = AutoConfig.from_pretrained(folder)
        if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {hf_config.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.shape = LlamaShape.from_hf_config(hf_config)
        self.max_model_len = config.max_model_len or self.shape.max_position_embeddings
        if self.max_model_len > self.shape.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len:,} exceeds the model's context length"
                f" {self.shape.max_position_embeddings:,}"
            )
        self.eos_token_ids = _eos_token_ids(folder, self.tokenizer)
        self.device = config.torch_device()
        self.resolved_dtype = config.resolved_dtype(self.device)
        self.dtype = self.resolved_dtype.dtype
        self.kv_cache_torch_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8" else self.dtype
        dense = config.quantization == "none"  # quantized layers have their own kernels
        gemm_shape = (2 * self.shape.intermediate_size, self.shape.hidden_size) if dense else None
        self.kernels = probe_kernels(self.device, self.dtype, gemm_shape)
        self.backend = select_backend(
            self.device, config.attention_backend, self.kv_cache_torch_dtype, kernels=self.kernels
        )
        check_kv_cache_dtype(self.backend, self.kv_cache_torch_dtype, self.device)

        model = LlamaForCausalLM(
            self.shape, self.backend, max_positions=self.max_model_len, gemm=self.kernels.gemm
        )
        load_weights(model, folder)
        num_parameters = sum(p.numel() for p in model.parameters())
        quantize(
            model, config.quantization, self.kernels
        )  # from the float32 checkpoint weights, before the cast
        if config.quantization != "none" and self.device.type == "cpu":
            logger.info(
                "%s decodes on this CPU: %s",
                config.quantization,
                "the VNNI kernels (vnni_gemm)"
                if self.kernels.vnni_gemm
                else "torch's weight-only kernels (the VNNI ones need AVX-512 VNNI and VBMI and gcc)",
            )
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.cos_sin_cache = self.model.cos_sin_cache.to(self.device)
        self.capacity_shape = model_shape_for_capacity(self.shape, num_parameters)
        # LoRA slots are allocated before the KV pool, so that a GPU's budget sees them.
        self.lora: LoraManager | None = None
        if config.enable_lora:
            self.lora = LoraManager(
                self.shape, config.max_loras, config.max_lora_rank, self.dtype, self.device
            )
            self.model.enable_lora(self.lora.stacks)

        num_blocks = self._num_kv_blocks()
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        cache_shape = (num_blocks, config.block_size, self.shape.num_kv_heads, self.shape.head_dim)

        def empty_cache() -> torch.Tensor:
            return torch.zeros(cache_shape, dtype=self.kv_cache_torch_dtype, device=self.device)

        self.kv_caches = [(empty_cache(), empty_cache()) for _ in range(self.shape.num_layers)]
        if self.kv_cache_torch_dtype == FP8_DTYPE:
            self._calibrate_fp8_kv_scales()
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        self.scheduler.on_finish = self._on_finish
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, self.shape.vocab_size, self.eos_token_ids
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_caches,
            self.kv_cache_manager,
            self.device,
            self.structured_outputs,
        )
        if config.compile:
            self._compile()
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.limits = Limits(
            vocab_size=self.shape.vocab_size,
            max_model_len=self.max_model_len,
            priority_floor=config.request_priority_floor,
        )
        logger.info(
            "engine ready: %s (%s) on %s/%s (%s), backend %s, %d KV blocks of %d tokens (%s tokens),"
            " max_model_len %d, quantization %s, KV cache %s",
            self.resolved.source,
            self.shape.num_layers,
            self.device,
            self.resolved_dtype.name,
            self.resolved_dtype.reason,
            self.backend.name,
            num_blocks,
            config.block_size,
            f"{num_blocks * config.block_size:,}",
            self.max_model_len,
            config.quantization,
            self.kv_dtype_name,
        )

    def _compile(self) -> None:
        compilation.check_can_compile(self.device)
        started = time.monotonic()
        max_tokens = min(
            self.config.max_num_batched_tokens,
            self.max_model_len,
            self.kv_cache_manager.num_total_blocks * self.config.block_size,
        )
        graphs = compilation.compile_all_sizes(
            self.model, self.kv_caches, self.config.block_size, max_tokens
        )
        logger.info(
            "compiled the decoder: %d graphs for 1..%d tokens in %.0f s",
            graphs,
            max_tokens,
            time.monotonic() - started,
        )

    def _calibrate_fp8_kv_scales(self) -> None:
        """Set each layer's fp8 KV scales from the amax of its K and V over a fixed text.

        One forward of ``KV_CALIBRATION_TEXT`` through a cache in the model's dtype (the pool is
        already allocated, so its size did not count this pass's memory). This runs before the
        scheduler exists and the scales never change afterwards: a prefix-cache block holds
        ``K / k_scale``, and a block written under other scales would be read wrong by every
        request that shares it. The scales follow from the pinned weights and the fixed text,
        so they are not part of the fingerprint.
        """
        token_ids = self.tokenizer.encode(KV_CALIBRATION_TEXT)[: self.max_model_len]
        amax = self.model.measure_kv_amax(token_ids, self.config.block_size, self.dtype)
        self.model.set_kv_scales([(fp8_kv_scale(k), fp8_kv_scale(v)) for k, v in amax])
        k_amax, v_amax = [k for k, _ in amax], [v for _, v in amax]
        logger.info(
            "fp8 KV scales calibrated on %d tokens: k amax %.3g..%.3g, v amax %.3g..%.3g"
            " across %d layers, each stored at e4m3 max / %g",
            len(token_ids), min(k_amax), max(k_amax), min(v_amax), max(v_amax),
            len(amax), FP8_KV_SCALE_HEADROOM,
        )  # fmt: skip

    @property
    def kv_dtype_name(self) -> str:
        """The KV-cache dtype as llmpool.capacity names it."""
        if self.config.kv_cache_dtype == "fp8":
            return "fp8"
        return self.resolved_dtype.name

    def _num_kv_blocks(self) -> int:
        config = self.config
        block_size = config.block_size
        blocks_per_seq = -(-self.max_model_len // block_size)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            memory = config.kv_cache_memory or self._default_kv_cache_bytes()
            num_blocks = capacity.num_kv_blocks(
                self.capacity_shape, self.kv_dtype_name, block_size, int(memory)
            )
            # More blocks than every sequence at full length could use is memory for nothing.
            num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV pool holds {num_blocks * block_size:,} tokens ({num_blocks} blocks of {block_size}),"
                f" fewer than one sequence of max_model_len {self.max_model_len:,}; lower max_model_len"
                " or give the cache more memory"
            )
        return num_blocks

    def _default_kv_cache_bytes(self) -> int:
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free
        # Keep room for one step's activations and logits beside the weights already loaded.
        activations = self.config.max_num_batched_tokens * (
            self.shape.hidden_size * 16 + self.shape.vocab_size * 4
        )
        budget = int(total * self.config.gpu_memory_utilization) - used_by_others - activations
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization {self.config.gpu_memory_utilization} leaves no memory for the KV cache"
            )
        return budget

    # --- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request, or raise InvalidRequestError (admission.py) and queue nothing.

        ``priority`` None means the engine's ``priority_class``; ``cache_salt`` keeps the
        request's prefix-cache blocks apart from those of requests with another salt;
        ``lora_name`` runs it with a loaded adapter (UnknownAdapterError if none is).
        """
        if lora_name is not None and (self.lora is None or lora_name not in self.lora.registry):
            raise UnknownAdapterError(lora_name)
        if priority is None:
            priority = PRIORITY_CLASSES[self.config.priority_class]
        sampling_params = admit(prompt_token_ids, sampling_params, priority, self.limits)
        grammar = None
        if sampling_params.structured_outputs is not None:
            try:
                grammar = self.structured_outputs.matcher(sampling_params.structured_outputs)
            except GrammarError as error:
                raise InvalidRequestError(str(error), param="structured_outputs") from None
        request = Request(
            request_id,
            prompt_token_ids,
            sampling_params,
            self.eos_token_ids,
            arrival_time,
            priority,
            cache_salt=cache_salt,
            grammar=grammar,
            lora=None if lora_name is None or self.lora is None else self.lora.acquire(lora_name),
        )
        try:
            self.scheduler.add_request(request)
        except ValueError:
            self._on_finish(request)
            raise
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            sampling_params.stop,
            sampling_params.include_stop_str_in_output,
            sampling_params.skip_special_tokens,
        )

    def _on_finish(self, request: Request) -> None:
        if request.lora is not None and self.lora is not None:
            self.lora.release(request.lora.slot)

    # --- adapters -------------------------------------------------------------------------

    def prepare_adapter(self, name: str, path: str, revision: str | None = None) -> AdapterWeights:
        """Read and check an adapter (any thread: it touches no engine state but the record of
        failures); :meth:`install_adapter` then puts it in a slot."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine (--enable-lora)")
        try:
            return read_adapter(
                name,
                path,
                shape=self.shape,
                max_rank=self.lora.max_rank,
                dtype=self.dtype,
                revision=revision,
            )
        except AdapterError as error:
            self.lora.record_failure(name, path, revision, error)
            raise

    def install_adapter(self, weights: AdapterWeights, replace: bool = False) -> LoadedAdapter:
        """Put a prepared adapter in a slot (the engine thread, between steps). A conflict (the
        name holds other files, no free slot) is not recorded as a failure of the adapter."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine (--enable-lora)")
        return self.lora.install(weights, replace)

    def load_adapter(self, name: str, path: str, revision: str | None = None) -> LoadedAdapter:
        return self.install_adapter(self.prepare_adapter(name, path, revision))

    def unload_adapter(self, name: str) -> None:
        """Unload at once for new requests; running ones finish on the adapter's slot."""
        if self.lora is None:
            raise UnknownAdapterError(name)
        self.lora.unload(name)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)
            self.detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.runner.timings.schedule += time.perf_counter() - started
        if scheduled.is_empty:
            return []
        result = self.runner.execute(scheduled)
        sampled_at = time.perf_counter()
        deltas = [self._fail(request, error) for request, error in result.failed]
        if result.failed:
            scheduled = scheduled.without({request.request_id for request, _ in result.failed})
        token_by_request = {
            request.request_id: token
            for request, token in zip(
                result.sampling_requests, result.sampled.token_ids, strict=True
            )
        }
        logprobs_by_request = {
            request.request_id: entry
            for request, entry in zip(
                result.sampling_requests, result.sampled.logprobs, strict=True
            )
        }
        changed = self.scheduler.update_from_output(scheduled, token_by_request)
        for request in changed:
            try:
                deltas.append(self._delta(request, logprobs_by_request[request.request_id]))
            except Exception as error:  # output processing of this request alone (detokenizing)
                deltas.append(self._fail(request, error))
        self.runner.timings.process_outputs += time.perf_counter() - sampled_at
        return deltas

    def _fail(self, request: Request, error: Exception) -> RequestDelta:
        """End one request whose own work raised; its blocks are freed and the loop goes on."""
        logger.error(
            "request %s failed in the engine step and was ended: %s: %s",
            request.request_id, type(error).__name__, error, exc_info=error,
        )  # fmt: skip
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
        self.detokenizers.pop(request.request_id, None)
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=RequestStatus.FINISHED_ERROR.value,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            error=f"{type(error).__name__}: {error}",
        )

    def _delta(self, request: Request, logprobs: dict[int, float] | None) -> RequestDelta:
        token_id = request.all_token_ids[-1]
        if request.grammar is not None:
            request.grammar.accept(token_id)
            if request.grammar.is_complete:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        detokenizer = self.detokenizers[request.request_id]
        stop_string = detokenizer.add_token(token_id)
        if stop_string is not None and not request.status.finished:
            request.stop_reason = stop_string
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        finished = request.status.finished
        if finished:
            del self.detokenizers[request.request_id]
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=[token_id],
            new_text=detokenizer.take_new_text(finished),
            new_logprobs=[logprobs] if logprobs is not None else [],
            finished=finished,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_total_blocks=self.kv_cache_manager.num_total_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            grammar_mask_seconds=self.runner.timings.grammar_mask,
            grammar_wait_seconds=self.runner.timings.grammar_wait,
            grammar_steps=self.runner.timings.grammar_steps,
            running_adapters=_adapter_names(self.scheduler.running),
            waiting_adapters=_adapter_names(self.scheduler.waiting),
        )


def _adapter_names(requests: list[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))


def _eos_token_ids(folder: Any, tokenizer: Any) -> frozenset[int]:
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
