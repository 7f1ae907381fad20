"""fp8 KV cache scales: perplexity and KL to the float32 cache, per choice of scale.

One float32 engine (float32 cache) is the reference; one fp8 engine is run with every layer's
scales at 1.0, then with calibrated scales (amax over ``KV_CALIBRATION_TEXT`` stored at
``448 / headroom``, exactly or rounded up to a power of two as the engine does) for several
headrooms, and with vLLM's dynamic constants (K amax at 200, V amax at 100). Each setting is
scored on texts that are not the calibration text: perplexity over each text in one forward
through the paged cache, and the mean KL divergence of the next-token distributions from the
float32 cache's, pooled over all texts. It is run again on the same model reparametrized to
K 32x larger and V 1024x smaller (the same function), the magnitudes where scale 1.0
saturates or underflows. CPU, float32 activations.

    python benchmarks/fp8_kv_scales.py
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from llmpool.bench.results import RESULTS, script_command, write_json
from llmpool.engine.config import EngineConfig
from llmpool.engine.engine_core import EngineCore
from llmpool.engine.kv_cache import (
    FP8_KV_SCALE_HEADROOM,
    FP8_MAX,
    KV_CALIBRATION_TEXT,
    fp8_kv_scale,
)
from llmpool.engine.scoring import next_token_log_probs, rescale_kv

EVAL_TEXTS = {
    # The text tests/test_quantization.py measures perplexity on.
    "river": (
        "The river begins high in the mountains, where snow melts in late spring and runs down in"
        " narrow streams. By the time it reaches the valley it is wide and slow, and the towns"
        " along its banks have used it for centuries: to drive mills, to carry timber and grain,"
        " and to bring water to the fields in dry summers. In the nineteenth century engineers"
        " straightened several of its bends to make room for railways and factories, and floods"
        " became more frequent downstream. Today some of those bends are being restored. Wetlands"
        " hold back the water after heavy rain, birds have returned to the reed beds, and the"
        " towns have learned that a river given room to spread is a river that does less damage"
        " when it does."
    ),
    "code": (
        "import json\n\n\nclass Inventory:\n    def __init__(self, path):\n        self.path = path\n"
        "        self.items = {}\n\n    def load(self):\n        with open(self.path) as f:\n"
        "            self.items = json.load(f)\n        return len(self.items)\n\n"
        "    def add(self, name, count=1):\n        self.items[name] = self.items.get(name, 0)"
        " + count\n\n    def total(self):\n        return sum(self.items.values())\n"
    ),
    "chat": (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat should"
        " I pack for a three-day hike in the mountains in October?<|im_end|>\n<|im_start|>"
        "assistant\nPack warm layers (a fleece and a waterproof jacket), sturdy boots, a map and"
        " compass, enough food and water for three days, a headlamp, a first-aid kit and a"
        " sleeping bag rated for freezing nights.<|im_end|>\n"
    ),
    "history": (
        "The history of computing is a story of abstraction layered on abstraction. Early machines"
        " were programmed by rewiring panels; later, stored programs let the same hardware run any"
        " procedure written as numbers in memory. Assemblers named those numbers, compilers turned"
        " formulas into instructions, and operating systems shared one machine among many users"
        " by slicing time and paging memory. Networks then joined machines into systems that no"
        " single person could see whole, and the work of programmers moved from the instructions"
        " of one processor to the contracts between services that fail independently. Each layer"
        " hid the one below it, until something went wrong and the lower layer had to be"
        " understood again, usually at night and under pressure."
    ),
    "numbers": (
        "Monthly rainfall in millimetres, 2019 to 2023:\n"
        "2019: 61, 48, 52, 39, 44, 30, 21, 18, 47, 83, 96, 74\n"
        "2020: 70, 55, 41, 27, 38, 26, 12, 25, 51, 90, 104, 88\n"
        "2021: 58, 62, 49, 45, 50, 35, 19, 22, 40, 77, 85, 69\n"
        "2022: 49, 40, 33, 30, 28, 15, 9, 14, 36, 71, 99, 91\n"
        "2023: 66, 59, 57, 42, 47, 33, 24, 20, 55, 88, 110, 95\n"
        "The wettest month on record was November 2023 with 110 mm; the driest, July 2022 with 9."
    ),
    "german": (
        "Die Stadtbibliothek öffnet am Montag nach der Renovierung wieder. Neu sind ein Lesesaal"
        " mit sechzig Plätzen, eine Werkstatt für Kinder und längere Öffnungszeiten am Samstag."
        " Ausgeliehene Bücher können ab sofort auch in den Filialen zurückgegeben werden, und die"
        " Gebühren für verspätete Rückgaben entfallen für alle Mitglieder unter achtzehn Jahren."
    ),
}
HEADROOMS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
# The same model with K 32x larger (amax past 448) and V 1024x smaller (amax below e4m3's
# normal range), as other checkpoints have them; powers of two keep the function exact.
STRESS_KEY_FACTOR = 32.0
STRESS_VALUE_FACTOR = 1 / 1024
COMMON = {"max_model_len": 512, "kv_cache_memory": "64MiB", "dtype": "float32"}


def score(log_probs: torch.Tensor, reference: torch.Tensor, token_ids: list[int]) -> dict:
    targets = torch.tensor(token_ids[1:])
    nll = -log_probs.gather(1, targets[:, None]).mean().item()
    kl = (reference.exp() * (reference - log_probs)).sum(-1).mean().item()
    return {"perplexity": math.exp(nll), "kl": kl}


def pooled(row: dict, texts: dict[str, list[int]]) -> dict:
    """Perplexity and KL over the tokens of every text together."""
    counts = {name: len(ids) - 1 for name, ids in texts.items()}
    total = sum(counts.values())
    nll = sum(math.log(row[name]["perplexity"]) * count for name, count in counts.items())
    kl = sum(row[name]["kl"] * count for name, count in counts.items())
    return {"perplexity": math.exp(nll / total), "kl": kl / total}


def scales_for(
    amax: list[tuple[float, float]], headroom: float, power_of_two: bool
) -> list[tuple[float, float]]:
    """Power of two: what the engine sets (``fp8_kv_scale``); else exactly amax at 448 / headroom."""
    if power_of_two:
        return [(fp8_kv_scale(k, headroom), fp8_kv_scale(v, headroom)) for k, v in amax]
    return [(k * headroom / FP8_MAX, v * headroom / FP8_MAX) for k, v in amax]


def run_settings(
    reference_core: EngineCore, fp8_core: EngineCore, label: str, texts: dict[str, list[int]]
) -> list[dict]:
    calibration_ids = fp8_core.tokenizer.encode(KV_CALIBRATION_TEXT)
    fp8_core.model.set_kv_scales([(1.0, 1.0)] * fp8_core.shape.num_layers)
    amax = fp8_core.model.measure_kv_amax(calibration_ids, 16, torch.float32)
    k_amax, v_amax = [k for k, _ in amax], [v for _, v in amax]
    print(
        f"{label}: calibrated on {len(calibration_ids)} tokens; k amax {min(k_amax):.4g}.."
        f"{max(k_amax):.4g}, v amax {min(v_amax):.4g}..{max(v_amax):.4g}"
    )
    settings: dict[str, list[tuple[float, float]]] = {"scale 1.0": [(1.0, 1.0)] * len(amax)}
    for headroom in HEADROOMS:
        settings[f"headroom {headroom:g}"] = scales_for(amax, headroom, power_of_two=False)
        chosen = " (engine default)" if headroom == FP8_KV_SCALE_HEADROOM else ""
        settings[f"headroom {headroom:g}, power of two{chosen}"] = scales_for(
            amax, headroom, power_of_two=True
        )
    settings["vLLM constants (k 200, v 100)"] = [(k / 200, v / 100) for k, v in amax]

    references = {name: next_token_log_probs(reference_core, ids) for name, ids in texts.items()}
    rows = []
    for setting, scales in settings.items():
        fp8_core.model.set_kv_scales(scales)
        row: dict = {"model": label, "setting": setting}
        for name, ids in texts.items():
            row[name] = score(next_token_log_probs(fp8_core, ids), references[name], ids)
        row["all"] = pooled(row, texts)
        rows.append(row)
        print(
            f"  {setting:42s} ppl {row['all']['perplexity']:8.3f}  KL {row['all']['kl']:.5f}"
            f"  (float32 cache ppl {pooled_reference(references, texts):.3f})",
            flush=True,
        )
    return rows


def pooled_reference(references: dict[str, torch.Tensor], texts: dict[str, list[int]]) -> float:
    total_nll = 0.0
    count = 0
    for name, ids in texts.items():
        targets = torch.tensor(ids[1:])
        total_nll -= references[name].gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(total_nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "fp8_kv_scales.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    reference_core = EngineCore(EngineConfig(**COMMON))
    fp8_core = EngineCore(EngineConfig(kv_cache_dtype="fp8", **COMMON))
    texts = {name: reference_core.tokenizer.encode(text) for name, text in EVAL_TEXTS.items()}
    rows = run_settings(reference_core, fp8_core, "SmolLM2-135M", texts)
    for core in (reference_core, fp8_core):
        rescale_kv(core.model, STRESS_KEY_FACTOR, STRESS_VALUE_FACTOR)
    rows += run_settings(
        reference_core,
        fp8_core,
        f"SmolLM2-135M, K x {STRESS_KEY_FACTOR:g}, V x {STRESS_VALUE_FACTOR:g}",
        texts,
    )
    result = {"eval_tokens": {name: len(ids) for name, ids in texts.items()}, "rows": rows}
    write_json(args.out, result, script_command(__file__))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
