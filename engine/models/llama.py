"""The Llama-family decoder (Llama, Mistral, Qwen2) written for a paged KV cache and flat batches."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmpool.engine.attention import AttentionMetadata, Backend
from llmpool.engine.attention.step import layer_attention, step_attention
from llmpool.engine.kernels import cpu_decoder
from llmpool.engine.kv_cache import allocate_kv_caches
from llmpool.engine.lora import DOWN, GATE_UP, O_PROJ, QKV
from llmpool.engine.lora.ops import LoraBatch, lora_add, step_lora
from llmpool.engine.models.int4 import Int4Linear
from llmpool.engine.models.linear import TORCH_GEMMS, GemmChoice, Linear, linear
from llmpool.engine.models.quantization import Int8Linear

if TYPE_CHECKING:
    from llmpool.engine.kernels.capabilities import KernelCapabilities
    from llmpool.engine.lora.manager import LoraStacks


@dataclass(frozen=True)
class LlamaShape:
    """The numbers of a checkpoint's config that the forward pass needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> LlamaShape:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling.
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_theta = rope.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0)
        scaling = rope or getattr(config, "rope_scaling", None)
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=config.max_position_embeddings,
            qkv_bias=bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


def rope_cos_sin_cache(shape: LlamaShape, max_positions: int) -> torch.Tensor:
    """``[max_positions, head_dim]`` float32: cos of each frequency, then sin.

    Computed as transformers does (int64 arange, float32 inverse frequencies), so positions
    rotate bit for bit like the reference; ``llama3`` and ``linear`` scaling are supported.
    """
    dim = shape.head_dim
    inv_freq = 1.0 / (
        shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = shape.rope_scaling
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        else:
            raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3)")
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class LlamaLayer(nn.Module):
    def __init__(self, shape: LlamaShape, index: int, gemm: GemmChoice) -> None:
        super().__init__()
        self.shape = shape
        self.index = index
        # Whether the step's adapter deltas are added (LlamaForCausalLM.enable_lora).
        self.lora = False
        q_size = shape.num_heads * shape.head_dim
        kv_size = shape.num_kv_heads * shape.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(shape.hidden_size))
        self.qkv_proj = Linear(
            shape.hidden_size, q_size + 2 * kv_size, bias=shape.qkv_bias, gemm=gemm
        )
        self.o_proj = Linear(q_size, shape.hidden_size, bias=False, gemm=gemm)
        self.post_attention_layernorm = nn.Parameter(torch.ones(shape.hidden_size))
        self.gate_up_proj = Linear(
            shape.hidden_size, 2 * shape.intermediate_size, bias=False, gemm=gemm
        )
        self.down_proj = Linear(shape.intermediate_size, shape.hidden_size, bias=False, gemm=gemm)
        self.split_sizes = [q_size, kv_size, kv_size]
        self.scale = shape.head_dim**-0.5
        # Per-tensor scales of an fp8 KV cache: it stores K / k_scale (kv_cache.quantize_fp8).
        # Calibrated once at load (engine_builder), fixed afterwards.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        backend: Backend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer inside ``step_attention``: ``(hidden, residual)`` for the next one."""
        shape = self.shape
        if residual is None:
            residual = hidden
            hidden = backend.rms_norm(hidden, self.input_layernorm, shape.rms_norm_eps)
        else:
            hidden, residual = backend.fused_add_rms_norm(
                hidden, residual, self.input_layernorm, shape.rms_norm_eps
            )
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.lora:
            lora_add(qkv, hidden, self.index, QKV)
        query, key, value = qkv.split(self.split_sizes, dim=-1)
        query = query.view(num_tokens, shape.num_heads, shape.head_dim)
        key = key.view(num_tokens, shape.num_kv_heads, shape.head_dim)
        value = value.view(num_tokens, shape.num_kv_heads, shape.head_dim)
        query, key = backend.rotary_embedding(positions, query, key, cos_sin_cache)
        key_cache, value_cache = kv_cache
        attended = layer_attention()(
            query, key, value, key_cache, value_cache, self.scale, self.k_scale, self.v_scale
        )
        attended = attended.view(num_tokens, -1)
        hidden = self.o_proj(attended)
        if self.lora:
            lora_add(hidden, attended, self.index, O_PROJ)
        hidden, residual = backend.fused_add_rms_norm(
            hidden, residual, self.post_attention_layernorm, shape.rms_norm_eps
        )
        gate_up = self.gate_up_proj(hidden)
        if self.lora:
            lora_add(gate_up, hidden, self.index, GATE_UP)
        activated = backend.silu_and_mul(gate_up)
        out = self.down_proj(activated)
        if self.lora:
            lora_add(out, activated, self.index, DOWN)
        return out, residual


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head over a flat batch of tokens."""

    def __init__(
        self,
        shape: LlamaShape,
        backend: Backend,
        max_positions: int,
        gemm: GemmChoice = TORCH_GEMMS,
    ) -> None:
        """``gemm``: the engine's bfloat16 GEMM choice (``kernels.capabilities``)."""
        super().__init__()
        self.shape = shape
        self.backend = backend
        self.gemm = gemm
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(shape, i, gemm) for i in range(shape.num_layers))
        self.lora_stacks: LoraStacks | None = None
        # Decode steps' layers in one C call, where they can run there (use_kernels).
        self.cpu_decoder: cpu_decoder.CpuDecoder | None = None
        self.norm = nn.Parameter(torch.ones(shape.hidden_size))
        if shape.tie_word_embeddings:
            self.lm_head = self.embed_tokens.weight
        else:
            self.lm_head = nn.Parameter(torch.empty(shape.vocab_size, shape.hidden_size))
        # A plain attribute, not a buffer: it must stay float32 when the weights are cast.
        self.cos_sin_cache = rope_cos_sin_cache(shape, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm; ``lora`` groups the
        rows that run with an adapter (None: all run the base model)."""
        decoder = self.cpu_decoder
        if decoder is not None and lora is None and decoder.takes(meta, self.backend):
            return decoder(input_ids, positions, kv_caches, meta)
        with step_attention(self.backend, meta), step_lora(self.backend, self.lora_stacks, lora):
            return self.decoder(input_ids, positions, kv_caches)

    def use_kernels(self, kernels: KernelCapabilities) -> None:
        """Switch every layer to ``kernels``, for eager forwards (a compiled decoder keeps what
        it traced), and decode steps to the C decoder where it runs: benchmarks measure one
        choice against another in one process."""
        self.gemm = kernels.gemm
        for module in self.modules():
            if isinstance(module, Linear | Int8Linear | Int4Linear):
                module.use_kernels(kernels)
        self.cpu_decoder = cpu_decoder.for_model(self, kernels)

    def enable_lora(self, stacks: LoraStacks) -> None:
        """Add the adapters of ``stacks``' slots to every projection, per row group."""
        self.lora_stacks = stacks
        for layer in self.layers:
            layer.lora = True

    def decoder(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Embeddings, layers and final norm: what ``compiled_decoder()`` compiles (attention excepted)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(
                hidden, residual, positions, kv_cache, self.cos_sin_cache, self.backend
            )
        hidden, _ = self.backend.fused_add_rms_norm(
            hidden, residual, self.norm, self.shape.rms_norm_eps
        )
        return hidden

    def compiled_decoder(self) -> Callable[..., torch.Tensor]:
        """``decoder`` under inductor, sizes dynamic (one token gets its own graph); it
        compiles at each size's first call, and ``forward`` runs it once ``use_decoder`` says so.

        Each layer's attention stays one opaque op (``attention.step``); everything else of a
        step (norms, residual adds, rotary, activations, GEMM calls) becomes one graph whose
        small ops are fused, so a decode step runs a few dozen kernels instead of ~1,000 ops.
        """
        return torch.compile(self.decoder, dynamic=True)

    def use_decoder(self, decoder: Callable[..., torch.Tensor]) -> None:
        """Run ``decoder`` in every later forward: one attribute swap, so a forward that another
        thread is running finishes on the decoder it began with."""
        self.decoder = decoder  # type: ignore[method-assign]

    @torch.inference_mode()
    def measure_kv_amax(
        self, token_ids: list[int], block_size: int, cache_dtype: torch.dtype
    ) -> list[tuple[float, float]]:
        """Each layer's largest ``|K|`` (after rotary, as written to the cache) and ``|V|``
        over one sequence of ``token_ids``, run through a throwaway cache of ``cache_dtype``.

        The cache must not be fp8 (its scales are what this measures); it starts zeroed, so
        its amax is the amax of what the forward wrote.
        """
        device = self.cos_sin_cache.device
        num_tokens = len(token_ids)
        num_blocks = -(-num_tokens // block_size)
        shape = self.shape
        kv_caches = allocate_kv_caches(
            shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim,
            cache_dtype, device,
        )  # fmt: skip
        meta = AttentionMetadata.one_sequence(num_tokens, block_size, device)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        self(input_ids, torch.arange(num_tokens, device=device), kv_caches, meta)
        amax = torch.stack(
            [torch.stack([k.abs().amax(), v.abs().amax()]) for k, v in kv_caches]
        ).float()
        return [(float(k), float(v)) for k, v in amax.tolist()]

    def set_kv_scales(self, scales: list[tuple[float, float]]) -> None:
        """``(k_scale, v_scale)`` of each layer's fp8 cache; see engine_builder for when this may run."""
        for layer, (k_scale, v_scale) in zip(self.layers, scales, strict=True):
            layer.k_scale, layer.v_scale = k_scale, v_scale

    @property
    def kv_scales(self) -> list[tuple[float, float]]:
        return [(layer.k_scale, layer.v_scale) for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits in the model's dtype: the sampler converts them to float32 only
        where it does more than take their argmax."""
        if isinstance(self.lm_head, nn.Module):  # quantized
            return self.lm_head(hidden)
        return linear(hidden, self.lm_head, gemm=self.gemm)
