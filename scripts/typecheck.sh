#!/usr/bin/env bash
# mypy on the engine core, the operator and the gateway. pyproject maps the folders engine/,
# operator/ and gateway/ to llmpool.engine, llmpool.operator and llmpool.gateway, which mypy
# cannot follow, so it checks a tree of symlinks laid out as the installed package is.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/llmpool"
for path in llmpool/*; do ln -s "$PWD/$path" "$tree/llmpool/"; done
ln -s "$PWD/engine" "$tree/llmpool/engine"
ln -s "$PWD/operator" "$tree/llmpool/operator"
ln -s "$PWD/gateway" "$tree/llmpool/gateway"
cd "$tree"
mypy --ignore-missing-imports --follow-imports=silent \
  -p llmpool.operator -p llmpool.gateway -p llmpool.protocol -m llmpool.prometheus -m llmpool.names \
  -m llmpool.engine.engine_builder -m llmpool.engine.kv_cache -m llmpool.engine.models.quantization \
  -m llmpool.engine.scheduler -m llmpool.engine.kv_cache_manager -m llmpool.engine.block_pool \
  -m llmpool.engine.request -m llmpool.engine.engine_core -m llmpool.engine.model_runner \
  -m llmpool.engine.attention.torch_backend -m llmpool.engine.attention.cpu_backend -m llmpool.engine.models.linear \
  -m llmpool.engine.admission -m llmpool.engine.sampler -m llmpool.engine.sampling_params \
  -m llmpool.engine.structured_outputs -m llmpool.engine.lora.manager -m llmpool.engine.lora.adapter \
  -m llmpool.engine.lora.ops -m llmpool.engine.models.int4 -m llmpool.engine.compile_cache -m llmpool.engine.gemm_store \
  -m llmpool.engine.kernels.c_loader -m llmpool.engine.kernels.capabilities -m llmpool.engine.kernels.cpu_lora \
  -m llmpool.engine.kernels.cpu_decode -m llmpool.engine.kernels.bf16_gemm -m llmpool.engine.kernels.vnni_gemm \
  -m llmpool.engine.kernels.sampling -m llmpool.engine.seeding -m llmpool.engine.server.tool_calls
