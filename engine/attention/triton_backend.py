"""The Triton backend: the CUDA path's kernels behind the torch reference's signatures."""

from __future__ import annotations

from llmpool.engine import ops
from llmpool.engine.attention import Backend
from llmpool.engine.kernels.kv_write import write_kv
from llmpool.engine.kernels.lora import lora_add, lora_plan
from llmpool.engine.kernels.paged_attention import paged_attention, plan
from llmpool.engine.kernels.rms_norm import fused_add_rms_norm, rms_norm
from llmpool.engine.kernels.rotary import rotary_embedding

TRITON = Backend(
    name="triton",
    plan=plan,
    write_kv=write_kv,
    paged_attention=paged_attention,
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    rotary_embedding=rotary_embedding,
    silu_and_mul=ops.silu_and_mul,
    lora_plan=lora_plan,
    lora_add=lora_add,
)
