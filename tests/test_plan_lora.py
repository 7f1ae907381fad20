"""LoRA slots in the memory plan: `llmpool plan` and capacity.lora_slot_bytes against a hand count."""

from __future__ import annotations

import json
import re

import pytest

from llmpool import capacity, plan

BUILTIN = "builtin://smollm2-135m-instruct"
GIB = 1024**3
# SmolLM2-135M: 30 layers, hidden 576, intermediate 1536, 9 heads and 3 KV heads of 64.
# Each of the seven projections holds in + out numbers per rank and layer (A is r x in, B out x r):
HAND_PER_RANK = (
    (576 + 576)  # q_proj
    + (576 + 192)  # k_proj
    + (576 + 192)  # v_proj
    + (576 + 576)  # o_proj
    + (576 + 1536)  # gate_proj
    + (576 + 1536)  # up_proj
    + (1536 + 576)  # down_proj
)
HAND_SLOT_FP32 = 30 * 16 * HAND_PER_RANK * 4  # 19,537,920 bytes at rank 16


def test_a_slot_is_every_projection_of_every_layer_at_the_max_rank():
    shape = capacity.BUILTIN_MODEL_SHAPES["smollm2-135m-instruct"]
    assert HAND_SLOT_FP32 == 19_537_920
    assert capacity.lora_slot_bytes(shape, 16, "float32") == HAND_SLOT_FP32
    assert capacity.lora_slot_bytes(shape, 8, "bfloat16") == HAND_SLOT_FP32 // 4


def test_the_slots_are_taken_before_the_kv_cache():
    base = plan.make_plan(BUILTIN, 2 * GIB, 4096, dtype="float32")
    lora = plan.make_plan(BUILTIN, 2 * GIB, 4096, dtype="float32", max_loras=4, max_lora_rank=16)
    assert base.lora_bytes == 0 and base.max_loras == 0
    assert lora.lora_bytes == 4 * HAND_SLOT_FP32
    assert lora.weight_bytes == base.weight_bytes
    assert lora.kv_cache_bytes == 2 * GIB - lora.weight_bytes - 4 * HAND_SLOT_FP32
    per_block = capacity.kv_bytes_per_block(
        capacity.BUILTIN_MODEL_SHAPES["smollm2-135m-instruct"], "float32", 16
    )
    assert lora.num_kv_blocks == lora.kv_cache_bytes // per_block < base.num_kv_blocks


def test_slots_that_leave_no_room_are_refused():
    weights = plan.make_plan(BUILTIN, 2 * GIB, 4096, dtype="float32").weight_bytes
    with pytest.raises(ValueError, match="64 LoRA slot"):
        plan.make_plan(BUILTIN, weights + 1024**2, 4096, dtype="float32", max_loras=64)
    with pytest.raises(ValueError, match="max_loras must be in 1..64"):
        plan.make_plan(BUILTIN, 2 * GIB, 4096, max_loras=65)
    with pytest.raises(ValueError, match="max_lora_rank in 1..256"):
        plan.make_plan(BUILTIN, 2 * GIB, 4096, max_loras=1, max_lora_rank=512)


def test_the_command_line_shows_the_slots(capsys):
    assert plan.main(["--memory", "2GiB", "--dtype", "float32", "--max-loras", "4", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["max_loras"], shown["max_lora_rank"]) == (4, 16)
    assert shown["lora_bytes"] == 4 * HAND_SLOT_FP32
    assert plan.main(["--memory", "2GiB", "--dtype", "float32", "--enable-lora"]) == 0
    text = capsys.readouterr().out
    assert re.search(rf"LoRA slots +{HAND_SLOT_FP32:,} B .*, 1 of rank 16", text)
    assert plan.main(["--memory", "2GiB"]) == 0
    assert "LoRA" not in capsys.readouterr().out
    assert plan.main(["--memory", "2GiB", "--max-loras", "65"]) == 1
