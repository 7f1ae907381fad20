"""Where a model comes from: resolve a source to a local HF folder and compute content digests."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from llmpool.engine import builtin_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class RevisionMismatchError(RuntimeError):
    """The files on disk are not the pinned revision; the engine must not serve them."""


@dataclass(frozen=True)
class ResolvedModel:
    source: str  # as the user wrote it, e.g. builtin://smollm2-135m-instruct or a path
    folder: Path  # a local HF-format folder
    revision: str  # sha256:<hex> content digest of what the source names


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def files_digest(files: list[Path], root: Path) -> str:
    """One digest over several files: each relative name and content digest, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(f"{path.relative_to(root)}\0{file_digest(path)}\n".encode())
    return "sha256:" + digest.hexdigest()


def weights_digest(folder: Path) -> str:
    return files_digest([*folder.glob("*.safetensors"), *folder.glob("config.json")], folder)


# A PEFT LoRA adapter's folder: its revision covers exactly these (engine/lora/adapter.py).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_digest(folder: Path) -> str:
    return files_digest([folder / name for name in ADAPTER_FILES], folder)


def tokenizer_digest(folder: Path) -> str:
    return files_digest(
        [folder / name for name in TOKENIZER_FILES if (folder / name).exists()], folder
    )


def resolve(model: str | None) -> ResolvedModel:
    """Map a model source to a folder; the built-in model's revision is its GGUF file's digest."""
    if model is None or model in (builtin_model.BUILTIN_SOURCE, builtin_model.BUILTIN_NAME):
        gguf_digest = file_digest(builtin_model.gguf_path())
        return ResolvedModel(
            source=builtin_model.BUILTIN_SOURCE,
            folder=builtin_model.builtin_folder(gguf_digest),
            revision=gguf_digest,
        )
    if model.startswith(("hf://", "pvc://")):
        raise ValueError(
            f"{model}: this engine loads local folders; mount the model and pass its path"
            " (the operator maps pvc:// and hf:// sources to a mounted path)"
        )
    folder = Path(model.removeprefix("file://"))
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (no config.json)")
    return ResolvedModel(
        source=model,
        folder=folder,
        revision=_folder_revision(folder),
    )


def _folder_revision(folder: Path) -> str:
    """A folder's revision covers its config, weights and tokenizer files."""
    files = [*folder.glob("*.safetensors"), folder / "config.json"]
    files += [folder / name for name in TOKENIZER_FILES if (folder / name).exists()]
    return files_digest(files, folder)


_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")


def verify_revision(resolved: ResolvedModel, expected: str | None) -> None:
    """A content digest must equal the files' digest; a commit SHA must name the HF snapshot.

    Hugging Face caches a commit's files under ``.../snapshots/<commit>/``, which is how an
    ``hf://`` source reaches the engine, so the folder name is what a commit pin is checked against.
    """
    if expected is None:
        return
    if _COMMIT_SHA.fullmatch(expected):
        folder = resolved.folder
        actual = folder.name if folder.parent.name == "snapshots" else "no snapshot commit"
    else:
        actual = resolved.revision
    if actual != expected:
        raise RevisionMismatchError(
            f"RevisionMismatch: {resolved.source} has revision {actual}, but {expected} was pinned"
        )
