"""LoRA adapters in the engine: the loader's refusals, the slot table, and the prefix cache."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from llmpool import capacity
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.lora.adapter import (
    AdapterError,
    module_dims,
    random_adapter,
    read_adapter,
    write_adapter,
)
from llmpool.engine.lora.manager import AdapterConflictError, LoraManager, UnknownAdapterError
from llmpool.engine.models.llama import LlamaShape
from llmpool.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def shape(builtin_folder: Path) -> LlamaShape:
    return LlamaShape.from_hf_config(AutoConfig.from_pretrained(builtin_folder))


def _read(shape: LlamaShape, folder: Path, **kwargs: object) -> object:
    return read_adapter("t", folder, shape=shape, max_rank=16, dtype=torch.float32, **kwargs)  # type: ignore[arg-type]


def _refusal(shape: LlamaShape, folder: Path, **kwargs: object) -> str:
    with pytest.raises(AdapterError) as error:
        _read(shape, folder, **kwargs)
    return error.value.code


def test_loader_refuses_what_it_cannot_serve(shape: LlamaShape, tmp_path: Path) -> None:
    good = tmp_path / "good"
    digest = random_adapter(good, shape, ["q_proj"], rank=8, alpha=16, seed=0)
    assert _read(shape, good, revision=digest).rank == 8  # type: ignore[attr-defined]
    assert _refusal(shape, good, revision="sha256:" + "0" * 64) == "revision_mismatch"
    assert _refusal(shape, tmp_path / "missing") == "invalid_adapter"

    big = tmp_path / "rank32"
    random_adapter(big, shape, ["q_proj"], rank=32, alpha=32, seed=0)
    assert _refusal(shape, big) == "lora_rank_exceeded"

    hidden = shape.hidden_size
    head = tmp_path / "lm-head"
    write_adapter(
        head, {(0, "q_proj"): (torch.ones(4, hidden), torch.ones(hidden, 4))}, rank=4, alpha=4
    )
    config = json.loads((head / "adapter_config.json").read_text())
    (head / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["lm_head"]}))
    assert _refusal(shape, head) == "unsupported_target_module"

    wrong = tmp_path / "wrong-base"  # a q_proj of another model's width
    write_adapter(
        wrong, {(0, "q_proj"): (torch.ones(4, hidden * 2), torch.ones(hidden, 4))}, rank=4, alpha=4
    )
    assert _refusal(shape, wrong) == "base_model_mismatch"
    deep = tmp_path / "deep"
    in_f, out_f = module_dims(shape, "q_proj")
    write_adapter(
        deep,
        {(shape.num_layers, "q_proj"): (torch.ones(4, in_f), torch.ones(out_f, 4))},
        rank=4,
        alpha=4,
    )
    assert _refusal(shape, deep) == "base_model_mismatch"

    dora = tmp_path / "dora"
    random_adapter(dora, shape, ["q_proj"], rank=4, alpha=4, seed=0)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert _refusal(shape, dora) == "invalid_adapter"
    (dora / "adapter_config.json").write_text("{not json")
    assert _refusal(shape, dora) == "invalid_adapter"


def test_slot_table(shape: LlamaShape, tmp_path: Path) -> None:
    manager = LoraManager(shape, 2, 16, torch.float32, torch.device("cpu"))
    builtin = capacity.BUILTIN_MODEL_SHAPES["smollm2-135m-instruct"]
    assert manager.nbytes == 2 * capacity.lora_slot_bytes(builtin, 16, "float32")

    def weights(name: str, seed: int) -> object:
        folder = tmp_path / f"{name}-{seed}"
        random_adapter(folder, shape, ["q_proj", "down_proj"], rank=8, alpha=16, seed=seed)
        return read_adapter(name, folder, shape=shape, max_rank=16, dtype=torch.float32)

    a = manager.install(weights("a", 0))  # type: ignore[arg-type]
    assert manager.install(weights("a", 0)) == a  # type: ignore[arg-type]
    with pytest.raises(AdapterConflictError) as error:
        manager.install(weights("a", 1))  # type: ignore[arg-type]
    assert error.value.code == "adapter_exists"
    b = manager.install(weights("b", 2))  # type: ignore[arg-type]
    with pytest.raises(AdapterConflictError) as error:
        manager.install(weights("c", 3))  # type: ignore[arg-type]
    assert error.value.code == "lora_slots_full"
    assert {a.slot, b.slot} == {0, 1}
    assert manager.stacks.scaling[b.slot] == 2.0

    # Unloaded while a request runs on it: gone for new requests, its slot freed at the end.
    manager.acquire("b")
    manager.unload("b")
    with pytest.raises(UnknownAdapterError):
        manager.acquire("b")
    with pytest.raises(AdapterConflictError):
        manager.install(weights("c", 3))  # type: ignore[arg-type]
    assert manager.stacks.a[0][0][b.slot].abs().sum() > 0
    manager.release(b.slot)
    assert manager.stacks.a[0][0][b.slot].abs().sum() == 0
    assert manager.install(weights("c", 3)).slot == b.slot  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory, shape: LlamaShape) -> EngineCore:
    core = EngineCore(
        EngineConfig(
            enable_lora=True, max_loras=2, dtype="float32", max_model_len=512, num_kv_blocks=64
        )
    )
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(["a", "b"]):
        random_adapter(root / name, shape, ["q_proj", "v_proj"], rank=8, alpha=16, seed=seed)
        core.load_adapter(name, str(root / name))
    return core


def _run(core: EngineCore, prompt: list[int], lora_name: str | None) -> list[int]:
    core.add_request(
        "r", prompt, SamplingParams(temperature=0, max_tokens=4, min_tokens=4), lora_name=lora_name
    )
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens += delta.new_token_ids
    return tokens


def test_prefix_cache_blocks_are_kept_per_adapter(core: EngineCore) -> None:
    prompt = list(range(1000, 1000 + 3 * core.config.block_size + 5))
    manager = core.kv_cache_manager
    for name in [None, "a", "b"]:
        before = manager.prefix_cache_hits
        _run(core, prompt, name)
        assert manager.prefix_cache_hits == before, f"{name} found blocks another adapter wrote"
    before = manager.prefix_cache_hits
    _run(core, prompt, "a")
    assert manager.prefix_cache_hits - before == 3 * core.config.block_size
    assert manager.usage == 0.0


def test_unknown_adapter_is_refused_and_queues_nothing(core: EngineCore) -> None:
    with pytest.raises(UnknownAdapterError):
        core.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), lora_name="nope")
    assert not core.has_unfinished_requests()
    assert core.stats().running_adapters == ()


def test_a_dropped_engine_is_freed_without_waiting_for_the_gc(
    tmp_path: Path, shape: LlamaShape
) -> None:
    """Its model and KV cache go with its last reference, not at some later full collection
    (which a long-lived process, full of objects, rarely runs): no cycle through the engine."""
    core = EngineCore(
        EngineConfig(enable_lora=True, dtype="float32", max_model_len=128, num_kv_blocks=16)
    )
    random_adapter(tmp_path / "a", shape, ["q_proj"], rank=8, alpha=16, seed=0)
    core.load_adapter("a", str(tmp_path / "a"))
    _run(core, [1, 2, 3], "a")
    engine, model = weakref.ref(core), weakref.ref(core.model)
    gc.disable()
    try:
        del core
        assert engine() is None and model() is None
    finally:
        gc.enable()
