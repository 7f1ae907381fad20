"""status.capacity from the shared KV sizing formula."""

from __future__ import annotations

from llmpool import capacity
from llmpool.operator.sizing import ENGINE_RUNTIME_BYTES, default_memory_limit, size_pool
from llmpool.operator.spec import PoolSpec

SHAPE = capacity.BUILTIN_MODEL_SHAPES["smollm2-135m-instruct"]


def test_builtin_capacity_on_cpu(chat_spec):
    """The example (no GPU) runs float32: 256 MiB hold 364 blocks, as the engine reports."""
    sizing = size_pool(PoolSpec.from_dict(chat_spec))
    per_token = capacity.kv_bytes_per_token(SHAPE, "float32")
    assert sizing.capacity["kvBlocks"] == 364
    blocks = 256 * 1024**2 // (per_token * 16)
    assert sizing.capacity == {
        "kvBytesPerToken": per_token,
        "kvBlocks": blocks,
        "maxSequences": blocks // (2048 // 16),
    }
    assert sizing.problems == []


def test_gpu_pools_size_bfloat16_and_fp8_halves_it(chat_spec):
    gpu = {**chat_spec, "resources": {"limits": {"nvidia.com/gpu": 1}}}
    bf16 = size_pool(PoolSpec.from_dict(gpu)).capacity["kvBytesPerToken"]
    assert bf16 == capacity.kv_bytes_per_token(SHAPE, "bfloat16")
    fp8 = size_pool(PoolSpec.from_dict({**gpu, "kvCacheDtype": "fp8"})).capacity
    assert fp8["kvBytesPerToken"] * 2 == bf16


def test_impossible_spec(chat_spec):
    spec = {**chat_spec, "engine": {**chat_spec["engine"], "kvCacheMemory": "1Mi"}}
    sizing = size_pool(PoolSpec.from_dict(spec))
    assert sizing.capacity["maxSequences"] == 0
    [problem] = sizing.problems
    assert "2,048" in problem and "kvCacheMemory" in problem


def test_unknown_memory_and_unknown_models(chat_spec):
    no_memory = {
        **chat_spec,
        "engine": {k: v for k, v in chat_spec["engine"].items() if k != "kvCacheMemory"},
    }
    sizing = size_pool(PoolSpec.from_dict(no_memory))
    assert "maxSequences" not in sizing.capacity and "kvCacheMemory" in sizing.capacity["message"]
    other = {**chat_spec, "model": {"source": "file:///m", "revision": "sha256:" + "1" * 64}}
    assert set(size_pool(PoolSpec.from_dict(other)).capacity) == {"message"}


def test_default_memory_limit_covers_weights_kv_cache_and_runtime(chat_spec):
    spec = {**chat_spec, "resources": {}}
    weights = capacity.weight_bytes(SHAPE, "float32")  # the widest `auto` picks on a CPU
    kv_cache = 256 * 2**20
    expected = -(-(weights + kv_cache + ENGINE_RUNTIME_BYTES) // 2**20)
    assert default_memory_limit(PoolSpec.from_dict(spec)) == f"{expected}Mi"
    # Weights are loaded before they are quantized: quantization does not lower the limit.
    int4 = PoolSpec.from_dict({**spec, "quantization": "int4"})
    assert default_memory_limit(int4) == f"{expected}Mi"
    # On a GPU the KV cache is device memory: the host holds the weights and the runtime.
    gpu = PoolSpec.from_dict({**spec, "resources": {"limits": {"nvidia.com/gpu": 1}}})
    gpu_weights = capacity.weight_bytes(SHAPE, "bfloat16")
    assert default_memory_limit(gpu) == f"{-(-(gpu_weights + ENGINE_RUNTIME_BYTES) // 2**20)}Mi"


def test_no_default_memory_limit_without_a_memory_plan(chat_spec):
    no_kv = {**chat_spec, "resources": {}, "engine": {"maxNumSeqs": 8}}
    assert default_memory_limit(PoolSpec.from_dict(no_kv)) is None
    unknown = {**chat_spec, "model": {"source": "hf://org/model", "revision": "a" * 40}}
    assert default_memory_limit(PoolSpec.from_dict(unknown)) is None


ADAPTER = {"name": "sql", "source": "file:///adapters/sql", "revision": "sha256:" + "a" * 64}


def test_lora_slots_are_in_the_capacity_and_a_cpu_pools_memory_limit(chat_spec):
    spec = {**chat_spec, "resources": {}}
    slot = capacity.lora_slot_bytes(SHAPE, 16, "float32")
    with_adapter = PoolSpec.from_dict({**spec, "adapters": [ADAPTER]})  # lora defaults: 4 x 16
    assert size_pool(with_adapter).capacity["loraBytes"] == 4 * slot
    eight = PoolSpec.from_dict({**spec, "lora": {"maxLoras": 8, "maxLoraRank": 8}})
    assert size_pool(eight).capacity["loraBytes"] == 8 * capacity.lora_slot_bytes(
        SHAPE, 8, "float32"
    )
    assert "loraBytes" not in size_pool(PoolSpec.from_dict(spec)).capacity

    weights = capacity.weight_bytes(SHAPE, "float32")
    kv_cache = 256 * 2**20
    expected = -(-(weights + kv_cache + 4 * slot + ENGINE_RUNTIME_BYTES) // 2**20)
    assert default_memory_limit(with_adapter) == f"{expected}Mi"
    # On a GPU the slots are device memory, as the KV cache is; they are bfloat16 there.
    gpu = {**spec, "adapters": [ADAPTER], "resources": {"limits": {"nvidia.com/gpu": 1}}}
    assert default_memory_limit(PoolSpec.from_dict(gpu)) == default_memory_limit(
        PoolSpec.from_dict({**gpu, "adapters": []})
    )
    bf16_slot = capacity.lora_slot_bytes(SHAPE, 16, "bfloat16")
    assert size_pool(PoolSpec.from_dict(gpu)).capacity["loraBytes"] == 4 * bf16_slot
